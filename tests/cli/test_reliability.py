"""No silent wrong results: labels follow the model's classes, base models get a trained head
first (``hydra-ens finetune``), Hugging Face datasets work as data, one built-in split loads
alone, and atomic writes clean what a killed writer left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel

from hydra_cli import main
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer, untrained_weights
from hydra_ensembles.saving.files import atomic_write_text

TINY = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}
COMMON = ["--batch-size", "8", "--max-length", "12"]


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliable")
    torch.manual_seed(0)
    BertModel(BertConfig(**TINY)).save_pretrained(root / "base")  # no classifier head
    load_tokenizer().save_pretrained(root / "base")
    words = {
        "sport": "goal match team score",
        "money": "bank shares market profit",
        "food": "flour bread oven",
    }
    rows = [(f"{text} {i}", label) for label, text in words.items() for i in range(8)]
    (root / "train.csv").write_text("text,label\n" + "\n".join(f"{t},{y}" for t, y in rows) + "\n")
    (root / "sport-only.csv").write_text("text,label\n" + "\n".join(f"{t},sport" for t, _ in rows[:8]) + "\n")
    return root


def _finetune(w) -> list[str]:
    """The fine-tuning command of the module's tests, less its ``--out``."""
    data = ["--data", str(w / "train.csv")]
    return ["finetune", str(w / "base"), *data, "--epochs", "2", "--lr", "1e-3", *COMMON]


def _tuned(w):
    """The module's fine-tuned model, ``w / "tuned"``: fine-tuned here where no test made it yet."""
    tuned = w / "tuned"
    if not tuned.is_dir():
        assert main([*_finetune(w), "--out", str(tuned)]) == 0
    return tuned


def test_finetune_gives_a_named_trained_head_that_score_accepts(w, capsys):
    assert main(["score", str(w / "base"), "--data", str(w / "train.csv"), "--out", str(w / "s.json")]) == 2
    assert "hydra-ens finetune" in capsys.readouterr().err and not (w / "s.json").exists()
    # the module's later tests reuse this folder; where one of them ran first (a rerun of chosen
    # tests, in another order) and made it, this test fine-tunes into a folder of its own
    tuned = w / "tuned"
    if tuned.exists():
        tuned = w / "tuned-named"
    assert main([*_finetune(w), "--out", str(tuned)]) == 0
    out = capsys.readouterr().out
    assert "epoch 2: train loss" in out and "3 classes" in out
    assert not tuned.with_name(f"{tuned.name}.checkpoint").exists()  # removed after success
    model = load_any(str(tuned))
    assert untrained_weights(model) == [] and model.config.id2label == {0: "food", 1: "money", 2: "sport"}
    assert (tuned / "tokenizer.json").is_file()
    assert main([*_finetune(w), "--out", str(tuned)]) == 2  # a finished model is not replaced
    assert "--overwrite" in capsys.readouterr().err
    args = ["--method", "taylor", "--heads-per-layer", "2", "--data", str(w / "train.csv"), *COMMON]
    assert main(["score", str(tuned), *args, "--out", str(w / "s.json")]) == 0


def test_a_finetuned_folder_changed_after_saving_is_refused_where_it_is_served(w, tmp_path, capsys):
    """finetune records every file's checksum: the folder loads and serves as written; with its
    tokenizer swapped for another, load_any, the tokenizer loader and the pipeline refuse it."""
    import shutil

    from transformers import pipeline

    from hydra_ensembles.loading import load_preprocessor

    tuned = tmp_path / "tuned"
    argv = ["finetune", str(w / "base"), "--data", str(w / "train.csv"), "--epochs", "1"]
    assert main([*argv[:-2], *COMMON, "--out", str(tuned)]) == 0  # --epochs auto
    said = capsys.readouterr()
    assert "--epochs auto: 20 epochs of 3 optimizer steps" in said.out  # 24 texts
    assert said.err.count("start from random values") == 1  # the new head, said once
    assert (tuned / "checksums.json").is_file()
    served = pipeline("hydra-text-classification", model=str(tuned))(["goal match"])
    assert served[0]["label"] in ("food", "money", "sport")
    swapped = tmp_path / "swapped"
    shutil.copytree(tuned, swapped)
    settings = json.loads((swapped / "tokenizer_config.json").read_text())
    (swapped / "tokenizer_config.json").write_text(json.dumps({**settings, "do_lower_case": False}))
    for load in (load_any, load_preprocessor, lambda f: pipeline("hydra-text-classification", model=f)):
        with pytest.raises(ValueError, match=r"tokenizer_config\.json was modified after saving"):
            load(str(swapped))


def test_a_random_head_is_accepted_only_when_asked_and_is_reproducible(w, capsys):
    args = ["--method", "taylor", "--heads-per-layer", "2", "--data", str(w / "train.csv"), *COMMON]
    base = str(w / "base")
    assert (
        main(["score", base, *args, "--num-labels", "3", "--allow-random-head", "--out", str(w / "a.json")])
        == 0
    )
    assert "start from random values" in capsys.readouterr().err
    assert (
        main(["score", base, *args, "--num-labels", "3", "--allow-random-head", "--out", str(w / "b.json")])
        == 0
    )
    assert json.loads((w / "a.json").read_text()) == json.loads((w / "b.json").read_text())


def test_eval_maps_a_file_lacking_a_class_onto_the_models_classes(w, capsys):
    tuned = _tuned(w)
    report = w / "report"
    argv = ["eval", "--method", f"m={tuned}", "--id-data", str(w / "sport-only.csv"), "--out", str(report)]
    assert main([*argv, *COMMON]) == 0
    reported = json.loads((report / "results.json").read_text())["results"]["m"]["classification"]["acc"]
    model, tokenizer = load_any(str(tuned)), load_tokenizer(str(tuned))
    texts = (w / "sport-only.csv").read_text().splitlines()[1:]
    batch = tokenizer(
        [t.rsplit(",", 1)[0] for t in texts],
        padding=True,
        truncation=True,
        max_length=12,
        return_tensors="pt",
    )
    with torch.no_grad():
        predicted = model(**batch).logits.argmax(-1)
    truth = (predicted == model.config.label2id["sport"]).float().mean().item()  # not label 0
    assert reported == pytest.approx(truth)


def test_eval_on_a_hugging_face_dataset_saved_to_disk(w, capsys):
    tuned = _tuned(w)
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=["sport", "money"])}
    )
    texts = ["goal match team score 1", "bank shares market profit 2", "team score 3"]
    split = datasets.Dataset.from_dict({"sentence": texts, "label": [0, 1, 0]}, features=features)
    datasets.DatasetDict({"validation": split, "test": split}).save_to_disk(str(w / "hf"))
    split.to_parquet(str(w / "hf.parquet"))
    for spec in (f"{w / 'hf'}", f"{w / 'hf'}:validation", f"{w / 'hf.parquet'}"):
        out = w / "hf-report"
        argv = ["eval", "--method", f"m={tuned}", "--id-data", spec, "--out", str(out), *COMMON]
        assert main(argv) == 0, capsys.readouterr().err
        acc = json.loads((out / "results.json").read_text())["results"]["m"]["classification"]["acc"]
        model = load_any(str(tuned))
        batch = load_tokenizer(str(tuned))(
            texts, padding=True, truncation=True, max_length=12, return_tensors="pt"
        )
        with torch.no_grad():
            predicted = model(**batch).logits.argmax(-1).tolist()
        names = [model.config.id2label[i] for i in predicted]  # ClassLabel names, not ids, decide
        truth = ["sport", "money", "sport"]
        assert acc == pytest.approx(np.mean([n == y for n, y in zip(names, truth, strict=True)]))


def test_eval_states_each_methods_training_and_warns_where_it_differs(w, tmp_path, capsys):
    """One epoch against two on the same data: the report names both step counts, and says (and
    warns) that the comparison mixes method and training; info prints the record too."""
    tuned = {}
    for epochs in ("1", "2"):
        tuned[epochs] = tmp_path / f"tuned-{epochs}"
        argv = ["finetune", str(w / "base"), "--data", str(w / "train.csv"), "--epochs", epochs]
        assert main([*argv, *COMMON, "--out", str(tuned[epochs])]) == 0
    assert main(["info", str(tuned["2"])]) == 0
    assert "fine-tuned: 6 optimizer steps since the pretrained weights" in capsys.readouterr().out
    argv = ["eval", "--method", f"one={tuned['1']}", "--method", f"two={tuned['2']}"]
    assert main([*argv, "--id-data", str(w / "train.csv"), "--out", str(tmp_path / "r"), *COMMON]) == 0
    assert "warning: the methods were trained differently" in capsys.readouterr().err
    report = (tmp_path / "r" / "report.md").read_text()
    assert "one: 3 optimizer steps; two: 6 optimizer steps (differs" in report


def test_hugging_face_images_and_unknown_hub_ids():
    from PIL import Image

    from hydra_ensembles.data import load_spec

    images = [Image.fromarray(np.full((8, 8), 40 * i, np.uint8)) for i in range(3)]
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    data = datasets.Dataset.from_dict({"img": images, "label": [0, 1, 1]}, features=features)
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hydra-hf-images-{os.getpid()}")
    data.save_to_disk(folder)
    loaded = load_spec(folder)
    assert loaded.images.shape == (3, 1, 8, 8) and loaded.classes == ["a", "b"] and loaded.labels == [0, 1, 1]
    assert np.allclose(loaded.images[2], 80 / 255)
    with pytest.raises(ValueError, match="local cache"):
        load_spec("hf:no-such-user/no-such-dataset:test")


def test_one_builtin_split_loads_without_the_other_corpora(tmp_path):
    """``bbc-news:test`` reads BBC News alone: it loads where the other corpora are missing."""
    code = (
        "import sys, os\n"
        "import hydra_experiments.datasets\n"  # the paper's data sets, as every hydra-ens command has them
        "from hydra_ensembles.data import load_spec\n"
        "data = load_spec('bbc-news:test')\n"
        "print(len(data), data.classes)\n"
    )
    env = {**os.environ, "HYDRA_DATA_DIR": str(tmp_path)}  # no SpamAssassin there
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "['business', 'entertainment', 'politics', 'sports']" in result.stdout


def test_atomic_writes_remove_what_a_killed_writer_left(tmp_path):
    target = tmp_path / "report.md"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".report.md.{dead.stdout.strip()}.abc123.tmp"
    stale.write_text("half")
    live = tmp_path / f".report.md.{os.getppid()}.def456.tmp"  # a live process's: kept
    live.write_text("in progress")
    atomic_write_text(target, "done")
    assert target.read_text() == "done" and not stale.exists() and live.exists()
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_finetune_says_which_epoch_it_kept_and_when_it_learned_nothing(w, capsys):
    argv = ["finetune", str(w / "base"), "--data", str(w / "train.csv"), "--val-data", str(w / "train.csv")]
    out = w / "patient"
    assert main([*argv, "--epochs", "2", "--lr", "1e-3", "--patience", "1", *COMMON, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kept epoch" in printed and "lowest validation NLL" in printed
    stuck = w / "stuck"
    assert main([*argv, "--epochs", "1", "--lr", "1e-9", *COMMON, "--out", str(stuck)]) == 0
    err = capsys.readouterr().err
    assert "never rose above 0.333, the share of the largest class" in err


def test_still_learning_is_said_only_while_accuracy_keeps_rising():
    from hydra_cli.common import still_learning

    rising = [{"val_acc": a} for a in (0.65, 0.71, 0.77)]  # a quick start's three short epochs
    assert still_learning(rising)
    assert not still_learning(rising[:2])  # two epochs say too little
    assert not still_learning([{"val_acc": a} for a in (0.65, 0.77, 0.77)])  # it levelled off
    assert not still_learning([{"val_acc": a} for a in (0.900, 0.902, 0.904)])  # within noise
