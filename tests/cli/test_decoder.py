"""A decoder LLM classifier with grouped-query attention from the command line: score (Taylor and
circuit) -> build --fine-tune -> eval -> predict, on a tiny random Llama whose tokenizer, like
most LLMs', has an end-of-sequence token and no padding token, and whose config names no padding
id (as a base checkpoint's does)."""

import csv
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast, pipeline

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.data import align_padding
from hydra_ensembles.layers import IndexedKVAttention
from hydra_ensembles.models import load_tokenizer
from tests.factories import rounding_tolerance

WORDS = ["goal", "match", "team", "score", "bank", "shares", "market", "profit", "recipe", "with", "flour"]


def _tokenizer(pad: bool = False) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, "<pad>": 2, **{w: i for i, w in enumerate(WORDS, 3)}}
    vocab |= {str(i): len(vocab) + i for i in range(12)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", pad_token="<pad>" if pad else None
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        num_labels=2,
        max_position_embeddings=32,
        initializer_range=0.2,
        pad_token_id=None,
    )
    LlamaForSequenceClassification(config).save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    rows = ["text,label"] + [f"goal match team score {i % 12},sport" for i in range(12)]
    rows += [f"bank shares market profit {i % 12},money" for i in range(12)]
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    (root / "ood.csv").write_text("text\n" + "\n".join(f"recipe with flour {i}" for i in range(10)) + "\n")
    return root


def test_score_build_eval_predict_in_fp32(workspace, capsys, monkeypatch):
    monkeypatch.setenv("HYDRA_PRECISION", "fp32")  # predict's records against the model run by hand in fp32
    w, common = workspace, ["--batch-size", "8", "--max-length", "12"]
    data = ["--data", str(w / "train.csv")]
    args = ["score", str(w / "model"), "--method", "taylor", "--heads-per-layer", "2", *data]
    assert main([*args, "--out", str(w / "taylor.json"), *common]) == 0
    assert len(json.loads((w / "taylor.json").read_text())["scores"]) == 2
    args = ["score", str(w / "model"), "--method", "circuit", *data, "--ood-data", str(w / "ood.csv")]
    assert main([*args, "--budget", "4", "--out", str(w / "circuit.json"), *common]) == 0
    assert len(json.loads((w / "circuit.json").read_text())["removed"]) == 4

    args = ["build", str(w / "model"), "--scores", str(w / "circuit.json"), "--members", "2"]
    args += ["--num-pruned", "2", "--pool-size", "4", "--fine-tune", *data, "--epochs", "1"]
    args += ["--val-data", str(w / "train.csv"), "--out", str(w / "built")]
    assert main([*args, *common]) == 0
    hydra = he.load_hydra(w / "built" / "hydra")
    assert hydra.num_members == 2 and hydra.config.id2label == {0: "money", 1: "sport"}
    assert hydra.config.pad_token_id == 1  # the end-of-sequence token pads, for the pooling too
    assert any(isinstance(m, IndexedKVAttention) for m in hydra.modules())
    assert load_tokenizer(str(w / "built" / "hydra")).pad_token_id == 1

    args = [
        "eval",
        "--method",
        f"hydra={w / 'built' / 'hydra'}",
        "--method",
        f"members={w / 'built' / 'members'}",
    ]
    args += ["--id-data", str(w / "train.csv"), "--ood", f"recipes={w / 'ood.csv'}:far"]
    assert main([*args, "--out", str(w / "report"), *common]) == 0
    report = (w / "report" / "report.md").read_text()
    assert "| hydra |" in report and "| members |" in report and "recipes (far) AUROC" in report

    out = w / "predictions.csv"
    args = ["predict", str(w / "built" / "hydra"), *data, "--labelled", "--out", str(out)]
    assert main([*args, *common]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 24 and {"predicted", "p_money", "p_sport", "flagged"} <= set(rows[0])
    # each text alone (no padding) gives the probabilities the padded batches gave
    temperature = saved_calibration(hydra).temperature
    tokenizer = load_tokenizer(str(w / "built" / "hydra"))
    for row in rows[::5]:
        with torch.no_grad():
            logits = hydra(**tokenizer([row["text"]], return_tensors="pt")).member_logits[:, 0]
        probs = (logits / temperature).softmax(-1).mean(0)
        expected = [float(row["p_money"]), float(row["p_sport"])]
        assert probs.tolist() == pytest.approx(expected, abs=1e-5)
    # served through the pipeline: the records predict wrote, and padded batches of ragged texts
    # give what each text gives alone (the pooling finds the last real token)
    folder = str(w / "built" / "hydra")
    served = pipeline("hydra-text-classification", model=folder, batch_size=5)
    # a flag is compared where the score is clear of the threshold by more than fp32's rounding
    # (predict's batches and the pipeline's are padded differently, so they round differently)
    records = served([row["text"] for row in rows])
    scores = torch.tensor([float(row["ood_score_mds"]) for row in rows])
    tol = rounding_tolerance("fp32", scores, layers=2)
    threshold = saved_calibration(hydra).flag.threshold
    for row, record in zip(rows, records, strict=True):
        assert record["predicted"] == row["predicted"]
        assert record["p_sport"] == pytest.approx(float(row["p_sport"]), abs=1e-5)
        assert record["ood_score_mds"] == pytest.approx(float(row["ood_score_mds"]), abs=tol)
        if abs(float(row["ood_score_mds"]) - threshold) > tol:
            assert record["flagged"] == (row["flagged"] == "True")
    ragged = [row["text"] + " flour" * (i % 3) for i, row in enumerate(rows)]
    alone = pipeline("hydra-text-classification", model=folder, batch_size=1)(ragged)
    for batched, single in zip(served(ragged), alone, strict=True):
        assert batched["predicted"] == single["predicted"]
        assert batched["p_sport"] == pytest.approx(single["p_sport"], abs=1e-5)
    served.tokenizer.pad_token = "<pad>"  # another tokenizer's padding: the pooling would read it
    with pytest.raises(ValueError, match="the pipeline's batch is padded with token id 2 but"):
        served(ragged)
    capsys.readouterr()


def test_padding_follows_the_model_or_is_refused():
    model = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, pad_token_id=None
        )
    )
    tokenizer = _tokenizer()
    align_padding(tokenizer, model)  # no padding token: the end-of-sequence token, for both
    assert tokenizer.pad_token_id == 1 and model.config.pad_token_id == 1
    model.config.pad_token_id = 2
    tokenizer = _tokenizer()
    align_padding(tokenizer, model)  # the model's padding id, where it names one
    assert tokenizer.pad_token_id == 2
    model.config.pad_token_id = 1
    with pytest.raises(ValueError, match=r"pads with token id 2 but the model's config\.pad_token_id is 1"):
        align_padding(_tokenizer(pad=True), model)


def test_info_names_the_family_and_its_key_value_heads(workspace, capsys):
    assert main(["info", "--families"]) == 0
    assert "Decoder LLM (grouped-query attention) (llama, mistral, qwen2" in capsys.readouterr().out
    assert main(["info", str(workspace / "model")]) == 0
    out = capsys.readouterr().out
    assert "family Decoder LLM (grouped-query attention)" in out
    assert "key/value heads per layer (grouped-query attention): [2, 2]" in out
