"""hydra-ens score -> build -> eval on small local models (BERT, DistilBERT) and CSV data."""

import csv
import json
import warnings

import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    pipeline,
)

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.calibration.provenance import DataRecord
from hydra_ensembles.data import load_spec, to_batches
from hydra_ensembles.evaluation import predict
from hydra_ensembles.evaluation.conformal import benjamini_hochberg
from hydra_ensembles.loading import load_any
from hydra_ensembles.members import DeepEnsemble
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.ood.registry import feature_scores
from hydra_ensembles.precision import resolve_precision
from tests.factories import computing_in, rounding_tolerance


def _model_and_tokenizer(family: str, folder):
    """A small random classifier with the real MiniLM vocabulary (30522 tokens) and tokenizer."""
    torch.manual_seed(0)
    if family == "bert":
        config = BertConfig(
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            num_labels=2,
            initializer_range=0.2,
        )
        BertForSequenceClassification(config).save_pretrained(folder)
    else:
        config = DistilBertConfig(dim=24, n_layers=2, n_heads=4, hidden_dim=48, initializer_range=0.2)
        DistilBertForSequenceClassification(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    if family == "distilbert":  # DistilBERT takes no token_type_ids; its own tokenizers say so
        settings = folder / "tokenizer_config.json"
        saved = json.loads(settings.read_text())
        settings.write_text(json.dumps({**saved, "model_input_names": ["input_ids", "attention_mask"]}))


def _family(w) -> str:
    """The family of the workspace's model (``bert`` or ``distilbert``)."""
    return json.loads((w / "model" / "config.json").read_text())["model_type"]


@pytest.fixture(scope="module", params=["bert", "distilbert"])
def workspace(tmp_path_factory, request):
    root = tmp_path_factory.mktemp(f"cli-{request.param}")
    _model_and_tokenizer(request.param, root / "model")
    rows = ["text,label"] + [f"goal match team score {i},sport" for i in range(12)]
    rows += [f"bank shares market profit {i},money" for i in range(12)]
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    (root / "ood.csv").write_text("text\n" + "\n".join(f"recipe with flour {i}" for i in range(10)) + "\n")
    return root


# DistilBERT's commands in the README's test command: every command in low precision, and the
# LoRA-Ensemble's build served by predict, the pipeline and ONNX; this test on it is CI's slow run
@pytest.mark.parametrize(
    "workspace", ["bert", pytest.param("distilbert", marks=pytest.mark.slow)], indirect=True
)
def test_score_build_eval(workspace, capsys):
    w = workspace
    common = ["--batch-size", "8", "--max-length", "12"]
    assert (
        main(
            [
                "score",
                str(w / "model"),
                "--method",
                "taylor",
                "--data",
                str(w / "train.csv"),
                "--heads-per-layer",
                "2",
                "--out",
                str(w / "taylor.json"),
                *common,
            ]
        )
        == 0
    )
    taylor = json.loads((w / "taylor.json").read_text())
    assert taylor["method"] == "taylor" and len(taylor["scores"]) == 2
    assert (
        main(
            [
                "score",
                str(w / "model"),
                "--method",
                "circuit",
                "--data",
                str(w / "train.csv"),
                "--ood-data",
                str(w / "ood.csv"),
                "--budget",
                "4",
                "--cache-gb",
                "0.5",
                "--out",
                str(w / "circuit.json"),
                *common,
            ]
        )
        == 0
    )
    circuit = json.loads((w / "circuit.json").read_text())
    assert len(circuit["removed"]) == 4 and len(circuit["scores"]) == 4

    assert (
        main(
            [
                "build",
                str(w / "model"),
                "--scores",
                str(w / "circuit.json"),
                "--members",
                "2",
                "--num-pruned",
                "2",
                "--pool-size",
                "4",
                "--fine-tune",
                "--data",
                str(w / "train.csv"),
                "--epochs",
                "1",
                "--out",
                str(w / "built"),
                *common,
            ]
        )
        == 0
    )
    hydra = he.load_hydra(w / "built" / "hydra")
    assert hydra.num_members == 2
    assert hydra.config.id2label == {0: "money", 1: "sport"}  # the training data's class names
    assert all(hs.num_kept([4, 4]) == 6 for hs in hydra.head_sets)
    explicit = DeepEnsemble.from_pretrained(w / "built" / "members")  # the members, unfused
    assert explicit.num_members == 2

    assert (
        main(
            [
                "eval",
                "--method",
                f"hydra={w / 'built' / 'hydra'}",
                "--method",
                f"single={w / 'model'}",
                "--tokenizer",
                str(w / "model"),
                "--id-data",
                str(w / "train.csv"),
                "--ood",
                f"recipes={w / 'ood.csv'}:far",
                "--val-data",
                str(w / "train.csv"),
                "--shift",
                "--shift-limit",
                "6",
                "--bootstrap",
                "40",
                "--out",
                str(w / "report"),
                *common,
            ]
        )
        == 0
    )
    report = (w / "report" / "report.md").read_text()
    assert "| hydra |" in report and "| single + TS |" in report and "recipes (far) AUROC" in report
    assert "Accuracy under shift" in report and "bootstrap intervals" in report
    assert "| single − hydra |" in report and "p=" in report  # paired with the first --method
    assert (w / "report" / "plots" / "roc_hydra.png").is_file()
    capsys.readouterr()

    hydra_dir, tokenizer = str(w / "built" / "hydra"), []  # build saved the tokenizer beside it
    labelled = ["--data", str(w / "train.csv"), "--labelled", "--val-data", str(w / "train.csv")]
    out, plot = w / "predictions.csv", w / "scores.png"
    assert (
        main(["predict", hydra_dir, *tokenizer, *labelled, "--out", str(out), "--plot", str(plot), *common])
        == 0
    )
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 24 and rows[0]["id"] == "train.csv/0" and rows[0]["text"].startswith("goal match")
    assert {"predicted", "confidence", "p_money", "p_sport", "entropy", "mutual_information"} <= set(rows[0])
    assert all(abs(float(r["p_money"]) + float(r["p_sport"]) - 1) < 1e-6 for r in rows)
    assert all(r["correct"] == str(r["predicted"] == r["label"]) for r in rows)
    flagged = sum(r["flagged"] == "True" for r in rows)
    assert flagged <= 2  # the threshold keeps 95% of these same (validation) inputs unflagged
    assert "24 predictions" in capsys.readouterr().out
    assert plot.stat().st_size > 0  # the score histograms with the threshold, where --plot says
    assert sorted(p.name for p in w.glob("predictions*")) == ["predictions.csv"]  # nothing unnamed

    out = w / "ood.jsonl"
    ensemble = f"{w / 'built' / 'members' / 'member-0'},{w / 'built' / 'members' / 'member-1'}"
    unlabelled = ["--data", str(w / "ood.csv"), "--out", str(out)]
    assert main(["predict", ensemble, *tokenizer, *unlabelled, *common]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10 and "flagged" not in records[0] and "label" not in records[0]
    assert {"p_money", "p_sport"} <= set(records[0])  # class names saved with the members
    assert all(0 <= r["members_agreeing"] <= 1 and r["mutual_information"] >= -1e-9 for r in records)


def test_build_saves_the_calibration_predict_uses(workspace, tmp_path, capsys):
    """build --val-data calibrates the fused model and the members' ensemble, flagging by default
    on the Mahalanobis score of the members' features on --data; predict then flags with the saved
    calibration (no --val-data), exactly as `Calibration.records` computes; a model without one is
    predicted at temperature 1 with a warning and no flag."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12"]
    data, built, scores = ["--data", str(w / "train.csv")], tmp_path / "built", tmp_path / "taylor.json"
    args = ["score", str(w / "model"), "--method", "taylor", "--heads-per-layer", "2", *data]
    assert main([*args, "--out", str(scores), *common]) == 0
    args = ["build", str(w / "model"), "--scores", str(scores), "--members", "2"]
    args += ["--num-pruned", "2", "--fine-tune", *data, "--val-data", str(w / "train.csv"), "--epochs", "1"]
    assert main([*args, "--keep", "0.9", "--out", str(built), *common]) == 0
    saved = saved_calibration(load_any(str(built / "hydra")))
    assert saved is not None and (saved.flag.score, saved.flag.keep, saved.examples) == ("mds", 0.9, 24)
    assert (
        saved.provenance.validation.name == str(w / "train.csv")
        and len(saved.provenance.validation.sha256) == 64
    )
    assert (
        saved.provenance.statistics.name == str(w / "train.csv")
        and saved.flag.statistics.settings["examples"] == 24
    )
    capsys.readouterr()
    assert main(["info", str(built / "members")]) == 0  # a saved ensemble of members
    said = capsys.readouterr().out
    assert "an ensemble of 2 saved members" in said and "calibration: temperature" in said
    assert "fit at 12 tokens per text" in said

    out = tmp_path / "p.csv"
    assert (
        main(["predict", str(built / "hydra"), "--data", str(w / "ood.csv"), "--out", str(out), *common]) == 0
    )
    assert "calibration saved with the model: temperature" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    hydra = load_any(str(built / "hydra"))
    batches = list(
        to_batches(load_spec(str(w / "ood.csv"), labelled=False), load_tokenizer(str(built / "hydra")), 8, 12)
    )
    expected = saved.records(predict(hydra, batches, progress=False), ["money", "sport"])
    assert [r["flagged"] == "True" for r in rows] == [e["flagged"] for e in expected]
    report = tmp_path / "report"  # eval measures what is served: the saved calibration, as saved
    ood = f"o={w / 'ood.csv'}:far"
    args = ["eval", "--method", f"hydra={built / 'hydra'}", "--id-data", str(w / "train.csv"), "--ood", ood]
    assert main([*args, "--out", str(report), *common]) == 0
    as_saved = json.loads((report / "results.json").read_text())["results"]["hydra (as saved)"]
    assert as_saved["flag_score"] == "mds"
    assert as_saved["flagged"]["o"] == pytest.approx(sum(r["flagged"] == "True" for r in rows) / len(rows))
    assert "## As served" in (report / "report.md").read_text()
    capsys.readouterr()
    assert [float(r["ood_score_mds"]) for r in rows] == pytest.approx([e["ood_score_mds"] for e in expected])
    assert saved.sets.method == "lac" and saved.sets.alpha == 0.1 and saved.sets.examples == 12  # half of 24
    assert [r["prediction_set"].split("|") if r["prediction_set"] else [] for r in rows] == [
        e["prediction_set"] for e in expected
    ]
    assert [int(r["set_size"]) for r in rows] == [e["set_size"] for e in expected]
    assert [float(r["ood_p_value"]) for r in rows] == pytest.approx([e["ood_p_value"] for e in expected])
    spread = [float(r["ood_score_mds_spread"]) for r in rows]
    assert spread == pytest.approx([e["ood_score_mds_spread"] for e in expected]) and max(spread) > 0

    out = tmp_path / "m.jsonl"  # the members' saved ensemble, with its own calibration
    assert (
        main(["predict", str(built / "members"), "--data", str(w / "ood.csv"), "--out", str(out), *common])
        == 0
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10 and {"flagged", "mutual_information", "ood_score_mds"} <= set(records[0])
    assert saved_calibration(load_any(str(built / "members"))).flag.keep == 0.9
    capsys.readouterr()

    out = tmp_path / "one.csv"  # one member, saved before any calibration
    assert main(["predict", str(built / "members" / "member-0"), *data, "--out", str(out), *common]) == 0
    assert "carries no calibration and no --val-data" in capsys.readouterr().err
    assert "flagged" not in next(csv.DictReader(out.open()))

    out = tmp_path / "fdr.csv"  # the batch's Benjamini-Hochberg selection on the saved p-values
    assert (
        main(
            [
                "predict",
                str(built / "hydra"),
                "--data",
                str(w / "ood.csv"),
                "--fdr",
                "0.2",
                "--out",
                str(out),
                *common,
            ]
        )
        == 0
    )
    fdr_rows = list(csv.DictReader(out.open()))
    chosen = benjamini_hochberg([float(r["ood_p_value"]) for r in fdr_rows], 0.2)
    assert [r["flagged"] == "True" for r in fdr_rows] == chosen.tolist()
    said = capsys.readouterr().out
    assert "Benjamini-Hochberg on the 10 inputs' conformal p-values" in said
    assert "the models' forward passes took" in said and "s (imports included)" in said
    assert ("nothing selected: the smallest p-value is" in said) == (not chosen.any())
    strict = tmp_path / "fdr-strict.csv"  # q so small that no p-value of its calibration can reach it
    args = [
        "predict",
        str(built / "hydra"),
        "--data",
        str(w / "ood.csv"),
        "--fdr",
        "1e-9",
        "--out",
        str(strict),
    ]
    assert main([*args, *common]) == 0
    assert "nothing selected" in capsys.readouterr().out
    out = tmp_path / "no-fdr.csv"  # a model without a conformal calibration has no p-values
    args = ["predict", str(built / "members" / "member-0"), *data, "--fdr", "0.1", "--out", str(out), *common]
    assert main(args) == 2 and not out.exists()
    assert "--fdr selects by conformal p-values" in capsys.readouterr().err

    out = tmp_path / "entropy.csv"  # another score needs data to fit it on
    args = ["predict", str(built / "hydra"), *data, "--flag-score", "entropy", "--out", str(out), *common]
    assert main(args) == 2 and not out.exists()
    assert "saved calibration flags on mds keeping 90%" in capsys.readouterr().err
    assert main([*args, "--val-data", str(w / "train.csv")]) == 0
    said = capsys.readouterr().out  # the score asked for; the saved level, flag method and sets kept
    assert "fit on --val-data (not saved with the model; settings not given as options are the saved" in said
    assert "ood_score_entropy >" in said and "conformal, level 0.1:" in said
    assert f"the saved temperature was {saved.temperature:.3f}" in said and "feature statistics" not in said
    assert "ood_score_entropy" in next(csv.DictReader(out.open()))

    # what build saved serves through transformers' pipeline with predict's flags, computed in the
    # precision predict used (autocast); in bf16/fp16 within the format's rounding, and the flags
    # compared where the score is farther than that from the threshold
    precision = resolve_precision("auto", "cpu").name
    texts = [row["text"] for row in csv.DictReader((w / "ood.csv").open())]
    for folder, written in ((built / "hydra", "p.csv"), (built / "members", "m.jsonl")):
        served = pipeline("hydra-text-classification", model=str(folder), truncation=True, max_length=12)
        with computing_in(precision):
            records = served(texts, batch_size=8)
        if written.endswith(".csv"):
            table = csv.DictReader((tmp_path / written).open())
            rows = [{**r, "flagged": r["flagged"] == "True"} for r in table]
        else:
            rows = [json.loads(line) for line in (tmp_path / written).read_text().splitlines()]
        scores = [float(r["ood_score_mds"]) for r in rows]
        tol = rounding_tolerance(precision, torch.tensor(scores), layers=2)
        assert [r["ood_score_mds"] for r in records] == pytest.approx(scores, abs=tol)
        threshold = saved_calibration(load_any(str(folder))).flag.threshold
        clear = [i for i, score in enumerate(scores) if abs(score - threshold) > tol]
        assert [records[i]["flagged"] for i in clear] == [rows[i]["flagged"] for i in clear]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_command_runs_in_low_precision_and_records_it(workspace, tmp_path, capsys, precision):
    """finetune -> score (Taylor, circuit) -> build (fine-tuned) -> eval -> predict with --precision
    bf16/fp16: each says what it computes in, and the files it writes record it."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12", "--precision", precision]
    data = ["--data", str(w / "train.csv")]
    tuned = tmp_path / "tuned"
    args = ["finetune", str(w / "model"), *data, "--val-data", str(w / "train.csv"), "--epochs", "1"]
    assert main([*args, "--out", str(tuned), *common]) == 0
    assert json.loads((tuned / "config.json").read_text())["hydra_training"]["precision"] == precision
    assert saved_calibration(load_any(str(tuned))).precision == precision  # fit on --val-data
    assert f"computing in {precision} (requested" in capsys.readouterr().out
    taylor = tmp_path / "taylor.json"
    args = ["score", str(tuned), "--method", "taylor", "--heads-per-layer", "2", *data]
    assert main([*args, "--out", str(taylor), *common]) == 0
    saved = json.loads(taylor.read_text())
    assert saved["precision"] == precision and len(saved["scores"]) == 2  # two layers scored
    capsys.readouterr()
    circuit = tmp_path / "circuit.json"
    args = ["score", str(w / "model"), "--method", "circuit", *data, "--ood-data", str(w / "ood.csv")]
    assert main([*args, "--budget", "3", "--out", str(circuit), *common]) == 0
    saved = json.loads(circuit.read_text())
    assert saved["precision"] == precision and saved["precision_reason"].startswith("requested")
    assert f"computing in {precision} (requested" in capsys.readouterr().out
    built = tmp_path / "built"
    args = ["build", str(w / "model"), "--scores", str(circuit), "--members", "2", "--num-pruned", "2"]
    assert main([*args, "--fine-tune", *data, "--epochs", "1", "--out", str(built), *common]) == 0
    hydra = he.load_hydra(built / "hydra")
    assert hydra.config.hydra_training["precision"] == precision
    capsys.readouterr()
    report = tmp_path / "report"
    args = ["eval", "--method", f"hydra={built / 'hydra'}", "--id-data", str(w / "train.csv")]
    assert main([*args, "--ood", f"recipes={w / 'ood.csv'}:far", "--out", str(report), *common]) == 0
    assert f"{precision} (requested" in (report / "report.md").read_text()
    out = tmp_path / "predictions.csv"
    assert main(["predict", str(built / "hydra"), *data, "--out", str(out), *common]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 24 and all(abs(float(r["p_money"]) + float(r["p_sport"]) - 1) < 1e-6 for r in rows)
    assert f"computing in {precision}" in capsys.readouterr().out


def test_cli_errors(workspace, capsys):
    w = workspace
    assert (
        main(
            [
                "score",
                str(w / "model"),
                "--method",
                "circuit",
                "--objective",
                "ood",
                "--data",
                str(w / "train.csv"),
                "--out",
                str(w / "x.json"),
            ]
        )
        == 2
    )
    assert "needs OOD validation data" in capsys.readouterr().err
    assert main(["eval", "--method", "broken", "--id-data", str(w / "train.csv"), "--out", str(w / "r")]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
    assert main(["score", str(w / "model"), "--data", "nonexistent-dataset", "--out", str(w / "y.json")]) == 2
    assert "unknown data" in capsys.readouterr().err
    missing = ["--data", str(w / "missing.csv"), "--out", str(w / "y.json")]
    assert main(["score", str(w / "model"), *missing]) == 2
    assert "missing.csv' does not exist" in capsys.readouterr().err


def test_predict_errors(workspace, capsys):
    w = workspace
    model, data, out = str(w / "model"), ["--data", str(w / "train.csv")], ["--out", str(w / "p.csv")]
    assert main(["predict", model, *data, "--val-data", "fortunes", *out]) == 2  # unlabelled
    assert "fortunes has no labels" in capsys.readouterr().err
    hydra = w / "zero-shot-hydra"
    he.fuse(load_any(model), [he.HeadSet({})]).save_pretrained(hydra)
    assert main(["predict", str(hydra), *data, *out]) == 2  # a saved Hydra model keeps no tokenizer
    assert "pass --tokenizer" in capsys.readouterr().err
    assert not (w / "p.csv").exists()


def test_finetune_saves_feature_statistics_that_predict_and_the_pipeline_serve(workspace, tmp_path, capsys):
    """finetune --data --val-data calibrates the plain classifier on the Mahalanobis score of its
    features on --data, saves the statistics beside its weights, and predict and the uncertainty
    pipeline (which serves a plain classifier as an ensemble of one) give the same scores and flags."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12"]
    tuned = tmp_path / "tuned"
    data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv"), "--epochs", "1"]
    assert main(["finetune", str(w / "model"), *data, "--out", str(tuned), *common]) == 0
    assert (tuned / "ood_statistics.safetensors").is_file()
    model = load_any(str(tuned))
    saved = saved_calibration(model)
    assert saved.flag.score == "mds" and saved.flag.statistics.num_members == 1
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(tuned), "--data", str(w / "ood.csv"), "--out", str(out), *common]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    texts = [row["text"] for row in rows]
    served = pipeline("hydra-text-classification", model=str(tuned), truncation=True, max_length=12)
    precision = resolve_precision("auto", "cpu").name
    with computing_in(precision):
        records = served(texts, batch_size=8)
    scores = [r["ood_score_mds"] for r in rows]
    tol = rounding_tolerance(precision, torch.tensor(scores), layers=2)
    assert [r["ood_score_mds"] for r in records] == pytest.approx(scores, abs=tol)
    clear = [i for i, s in enumerate(scores) if abs(s - saved.flag.threshold) > tol]
    assert [records[i]["flagged"] for i in clear] == [rows[i]["flagged"] for i in clear]
    # a refit on --val-data keeps the saved calibration's settings (score, level, sets), and says so
    refit = tmp_path / "refit.jsonl"
    capsys.readouterr()
    args = ["--data", str(w / "ood.csv"), "--val-data", str(w / "train.csv"), "--out", str(refit)]
    assert main(["predict", str(tuned), *args, *common]) == 0
    said = capsys.readouterr().out
    assert "settings not given as options are the saved calibration's" in said and "ood_score_mds >" in said
    first = json.loads(refit.read_text().splitlines()[0])
    assert "ood_score_mds" in first and ("prediction_set" in first) == (saved.sets is not None)
    assert f"level {saved.flag.alpha:.3g}" in said


@pytest.mark.parametrize(
    "workspace", ["bert", pytest.param("distilbert", marks=pytest.mark.slow)], indirect=True
)
def test_the_length_a_model_was_fit_at_is_served_with_it(workspace, tmp_path, capsys):
    """finetune --max-length saves the length with the model: predict (no --max-length) and the
    pipeline (no truncation arguments) cut texts to it, so they serve what was calibrated."""
    w = workspace
    tuned = tmp_path / "tuned"
    data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv"), "--epochs", "1"]
    assert main(["finetune", str(w / "model"), *data, "--max-length", "8", "--out", str(tuned)]) == 0
    assert load_any(str(tuned)).config.hydra_max_length == 8
    long = tmp_path / "long.csv"  # texts of more than 8 tokens
    long.write_text(
        "text\n" + "\n".join(f"bank shares {i} and then many more words {i} {i}" for i in range(8))
    )
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(tuned), "--data", str(long), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    texts, scores = [r["text"] for r in rows], [r["ood_score_mds"] for r in rows]
    precision = resolve_precision("auto", "cpu").name
    tol = rounding_tolerance(precision, torch.tensor(scores), layers=2)
    classify = pipeline("hydra-text-classification", model=str(tuned))
    with computing_in(precision):
        served = classify(texts, batch_size=4)
    assert [s["ood_score_mds"] for s in served] == pytest.approx(scores, abs=tol)
    assert classify.preprocess(texts[0])["input_ids"].shape[1] == 8  # cut where it was fit
    onnx = tmp_path / "onnx"  # the ONNX graph, fed as docs/serving.md feeds it, serves the same
    assert main(["export", str(tuned), "--format", "onnx", "--out", str(onnx)]) == 0
    import onnxruntime

    from hydra_ensembles.serving.onnx import TOLERANCE

    saved = saved_calibration(load_any(str(tuned)))
    side = json.loads((onnx / "calibration.json").read_text())
    encoded = AutoTokenizer.from_pretrained(onnx)(texts, padding=True, truncation=True, return_tensors="np")
    assert side["max_length"] == 8 and encoded["input_ids"].shape[1] == 8
    session = onnxruntime.InferenceSession(str(onnx / "model.onnx"))
    feed = {name: encoded[name].astype("int64") for name in side["inputs"]}
    graph = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True))
    graph_tol = tol + TOLERANCE * max(scores)  # what export accepts of a score (relative)
    assert graph["ood_score"].tolist() == pytest.approx(scores, abs=graph_tol)
    clear = [i for i, s in enumerate(scores) if abs(s - saved.flag.threshold) > graph_tol]
    flagged = graph["ood_score"] > side["calibration"]["flag"]["threshold"]
    assert [bool(flagged[i]) for i in clear] == [rows[i]["flagged"] for i in clear]
    probs = torch.tensor([[r[f"p_{name}"] for name in side["classes"]] for r in rows])
    p_tol = rounding_tolerance(precision, probs, layers=2, fp32=1e-5)
    torch.testing.assert_close(torch.from_numpy(graph["logits"]).exp(), probs, atol=p_tol, rtol=0)
    longer = pipeline("hydra-text-classification", model=str(tuned), truncation=True, max_length=12)
    with pytest.warns(UserWarning, match="calibrated on texts of 8 tokens and is asked for 12"):
        assert (
            longer.preprocess(texts[0], **longer._preprocess_params)["input_ids"].shape[1] == 12
        )  # as asked


def test_calibrate_refits_a_saved_model_without_training_and_saves_it_anew(workspace, tmp_path, capsys):
    """calibrate: the flag score chosen on OOD validation data, every candidate's AUROC printed,
    the OOD data's digest recorded; the weights unchanged, the input folder untouched, and
    predict and the uncertainty pipeline serve the new calibration."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12"]
    tuned = tmp_path / "tuned"
    data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv"), "--epochs", "1"]
    assert main(["finetune", str(w / "model"), *data, "--out", str(tuned), *common]) == 0
    before = {p.name: p.read_bytes() for p in tuned.iterdir() if p.is_file()}
    capsys.readouterr()
    out = tmp_path / "recalibrated"
    args = ["calibrate", str(tuned), "--val-data", str(w / "train.csv"), "--ood-data", str(w / "ood.csv")]
    assert main([*args, "--keep", "0.9", "--out", str(out), *common]) == 0
    said = capsys.readouterr().out
    assert "validation AUROC of each score" in said and "<- the flag score" in said
    assert {p.name: p.read_bytes() for p in tuned.iterdir() if p.is_file()} == before
    new, old = load_any(str(out)), load_any(str(tuned))
    calibration = saved_calibration(new)
    assert calibration.flag.keep == 0.9 and calibration.provenance.ood.name == str(w / "ood.csv")
    assert (
        len(calibration.provenance.ood.sha256) == 64
        and "<- the flag score" in said.split(calibration.flag.score)[1]
    )
    for (name, a), (_, b) in zip(new.named_parameters(), old.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    rows_out = tmp_path / "p.jsonl"
    assert main(["predict", str(out), "--data", str(w / "ood.csv"), "--out", str(rows_out), *common]) == 0
    rows = [json.loads(line) for line in rows_out.read_text().splitlines()]
    assert f"ood_score_{calibration.flag.score}" in rows[0]
    served = pipeline("hydra-text-classification", model=str(out), truncation=True, max_length=12)
    assert f"ood_score_{calibration.flag.score}" in served(rows[0]["text"])[0]
    assert main(["calibrate", str(tuned), "--val-data", str(w / "train.csv"), "--out", str(tuned)]) == 2
    again = tmp_path / "again"  # on the data finetune calibrated on: finetune's calibration exactly
    args = ["calibrate", str(tuned), "--val-data", str(w / "train.csv"), "--data", str(w / "train.csv")]
    assert main([*args, "--out", str(again), *common]) == 0
    assert saved_calibration(load_any(str(again))) == saved_calibration(old)
    # without --data, the saved statistics flag, recorded with the data they were fit on, by
    # calibrate and by predict --val-data alike (the library's one fit path)
    kept, fitted = tmp_path / "kept", saved_calibration(old)
    args = ["calibrate", str(again), "--val-data", str(w / "train.csv"), "--flag-score", "mds"]
    assert main([*args, "--out", str(kept), *common]) == 0
    refit = saved_calibration(load_any(str(kept)))
    assert refit.flag.score == "mds" and refit.flag.statistics_sha256 == fitted.flag.statistics_sha256
    assert refit.provenance.statistics == fitted.provenance.statistics
    assert fitted.provenance.statistics == DataRecord(
        str(w / "train.csv"), fitted.provenance.statistics.sha256
    )
    capsys.readouterr()
    args = ["predict", str(again), "--data", str(w / "ood.csv"), "--out", str(tmp_path / "v.jsonl")]
    assert main([*args, "--val-data", str(w / "train.csv"), "--flag-score", "mds", *common]) == 0
    said = capsys.readouterr().out
    assert f"feature statistics fit on {w / 'train.csv'}" in said
    assert f"sha256 {fitted.provenance.statistics.sha256[:12]}" in said


def _served_alike(w, tmp_path, folder, common, precision, export: bool = True) -> None:
    """predict, the uncertainty pipeline and (with ``export``, but for an ensemble of members,
    exported member by member) the exported graph give the saved model's flag score and class on
    the OOD texts alike, within ``precision``'s rounding (the graph computes in fp32), and the same
    flags where a score is clear of the threshold."""
    import onnxruntime

    from hydra_ensembles.serving.onnx import TOLERANCE

    calibration = saved_calibration(load_any(str(folder)))
    assert calibration is not None and calibration.flag.score in feature_scores()
    key = f"ood_score_{calibration.flag.score}"
    out = tmp_path / f"{folder.name}.jsonl"
    assert main(["predict", str(folder), "--data", str(w / "ood.csv"), "--out", str(out), *common]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    scores = [r[key] for r in rows]
    tol = rounding_tolerance(precision, torch.tensor(scores), layers=2)
    served = pipeline(
        "hydra-text-classification", model=str(folder), truncation=True, max_length=12, precision=precision
    )
    records = served([r["text"] for r in rows], batch_size=3)
    assert [r[key] for r in records] == pytest.approx(scores, abs=tol)
    clear = [i for i, s in enumerate(scores) if abs(s - calibration.flag.threshold) > tol]
    assert [records[i]["flagged"] for i in clear] == [rows[i]["flagged"] for i in clear]
    if folder.name == "members" or not export:
        return
    onnx = tmp_path / f"{folder.name}-onnx"
    assert main(["export", str(folder), "--format", "onnx", "--out", str(onnx)]) == 0
    side = json.loads((onnx / "calibration.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(onnx)
    encoded = tokenizer(
        [r["text"] for r in rows], padding=True, truncation=True, max_length=12, return_tensors="np"
    )
    feed = {name: encoded[name].astype("int64") for name in side["inputs"]}
    session = onnxruntime.InferenceSession(str(onnx / "model.onnx"))
    logits, graph = session.run(["logits", "ood_score"], feed)
    assert graph.tolist() == pytest.approx(scores, abs=tol + TOLERANCE * max(abs(s) for s in scores))
    probs = torch.as_tensor(logits).softmax(-1)
    confident = [i for i, r in enumerate(rows) if float(probs[i].topk(2).values.diff().abs()) > tol]
    classes = side["classes"]
    assert [classes[int(probs[i].argmax())] for i in confident] == [rows[i]["predicted"] for i in confident]


@pytest.mark.slow  # four models, each served three ways, in every precision: CI's slow run
@pytest.mark.parametrize("workspace", ["bert", "distilbert"], indirect=True)
def test_a_flag_on_every_layers_view_is_served_alike_by_predict_the_pipeline_and_onnx(
    workspace, tmp_path, capsys
):
    """finetune and build flagging on mds_layers (every layer's token, per member): predict, the
    uncertainty pipeline (a plain classifier, a fused model, an ensemble of members) and the
    exported graph give the same score and flag, within the precision's rounding."""

    w, common = workspace, ["--batch-size", "8", "--max-length", "12"]
    data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv"), "--flag-score", "mds_layers"]
    tuned = tmp_path / "tuned"
    assert main(["finetune", str(w / "model"), *data, "--epochs", "1", "--out", str(tuned), *common]) == 0
    built, ranked = tmp_path / "built", tmp_path / "taylor.json"
    args = ["score", str(w / "model"), "--method", "taylor", "--heads-per-layer", "2", *data[:2]]
    assert main([*args, "--out", str(ranked), *common]) == 0
    args = ["build", str(w / "model"), "--scores", str(ranked), "--members", "2", "--num-pruned", "2", *data]
    assert main([*args, "--fine-tune", "--epochs", "1", "--out", str(built), *common]) == 0
    precision = resolve_precision("auto", "cpu").name
    for folder in (tuned, built / "hydra", built / "members"):
        assert saved_calibration(load_any(str(folder))).flag.score == "mds_layers"
        _served_alike(w, tmp_path, folder, common, precision)
    disagreement = tmp_path / "disagreement"  # calibrate's output, flagging on another layer score
    args = ["calibrate", str(built / "hydra"), *data[:4], "--flag-score", "mds_disagreement"]
    assert main([*args, "--out", str(disagreement), *common]) == 0
    _eval_measures_what_was_saved(w, tmp_path, common, {"tuned": tuned, "hydra": built / "hydra",
                                                         "disagreement": disagreement})  # fmt: skip
    capsys.readouterr()


def _eval_measures_what_was_saved(w, tmp_path, common, folders) -> None:
    """eval measures each model as it was saved by finetune, build and calibrate, with its layer
    score (every layer's token is recorded), and offers the layer scores for every method."""
    methods = [a for name, folder in folders.items() for a in ("--method", f"{name}={folder}")]
    data = ["--id-data", str(w / "train.csv"), "--train-data", str(w / "train.csv")]
    data += ["--val-data", str(w / "train.csv"), "--ood", f"recipes={w / 'ood.csv'}:far"]
    assert main(["eval", *methods, *data, "--out", str(tmp_path / "report"), *common]) == 0
    results = json.loads((tmp_path / "report" / "results.json").read_text())["results"]
    for name, folder in folders.items():
        saved = saved_calibration(load_any(str(folder)))
        assert results[f"{name} (as saved)"]["flag_score"] == saved.flag.score
        assert "mds_layers" in results[name]["ood"]["recipes"]["scores"]


def test_eval_warns_where_the_methods_were_calibrated_on_different_data(monkeypatch):
    """The "as saved" rows compare served flags: where the calibrations were fit on different data
    (here one chose its flag score on OOD validation data, the other on none), eval says so."""
    import types

    from hydra_cli import evaluate
    from hydra_ensembles import calibration as calibrations
    from hydra_ensembles.calibration import DataRecord, Provenance

    def calibration(ood: str):
        read = (
            DataRecord("val.csv", "a" * 64),
            DataRecord("train.csv", "c" * 64),
            DataRecord(ood, ood and "b" * 64),
        )
        return types.SimpleNamespace(provenance=Provenance(*read))

    found = {"single": calibration(""), "hydra": calibration("ood_val.csv")}
    monkeypatch.setattr(calibrations, "saved_calibration", lambda model: found[model])
    with pytest.warns(UserWarning, match="fit on different data .*OOD validation ood_val.csv"):
        evaluate._warn_calibrated_apart({"single": ["single"], "hydra": ["hydra"]})
    found["single"] = calibration("ood_val.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate._warn_calibrated_apart({"single": ["single"], "hydra": ["hydra"]})


def test_the_pipeline_answers_threads_at_once_as_it_answers_one_at_a_time(workspace):
    """Threads sharing one pipeline (a threaded web server's workers): each call's records are the
    records of the same call made alone; the feature tap's hooks never record another thread's
    forward pass."""
    from concurrent.futures import ThreadPoolExecutor

    served = pipeline(
        "hydra-text-classification", model=str(workspace / "model"), truncation=True, max_length=12
    )
    texts = [f"goal match team score {i}" if i % 2 else f"recipe with flour and sugar {i}" for i in range(24)]
    alone = [served(text) for text in texts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(served, texts))
    assert together == alone


def _assert_predicts_as_its_members(w, hydra, members) -> None:
    """The fused model's members' logits on the OOD texts are their explicit ensemble's (fp32)."""
    batches = list(
        to_batches(load_spec(str(w / "ood.csv"), labelled=False), load_tokenizer(str(w / "model")), 8, 12)
    )
    fused = predict(hydra, batches, progress=False, precision="fp32")
    explicit = predict(members, batches, progress=False, precision="fp32")
    torch.testing.assert_close(
        torch.as_tensor(fused.member_logits), torch.as_tensor(explicit.member_logits), rtol=1e-5, atol=1e-5
    )


@pytest.mark.same_in_every_precision  # built, predicted, served and exported in fp32, as asked
def test_build_with_no_head_pruned_is_a_fused_deep_ensemble_of_fine_tunes(workspace, tmp_path, capsys):
    """--num-pruned 0 --fine-tune, no ranking: members that keep every head, each fine-tuned with
    its own seed, fused with every part per member (the MLPs exact by default): the fused model
    predicts what the saved members' explicit ensemble predicts, and carries its calibration.
    Without --fine-tune, or with --mlp merge (averaged MLPs: not their ensemble), it is refused
    in one line before any work."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12", "--precision", "fp32"]
    args = ["build", str(w / "model"), "--members", "2", "--num-pruned", "0", "--data", str(w / "train.csv")]
    args += ["--val-data", str(w / "train.csv"), *common]
    for extra, message in (([], "give --fine-tune"), (["--fine-tune", "--mlp", "merge"], "mlp='exact'")):
        assert main([*args, *extra, "--out", str(tmp_path / "refused")]) == 2
        assert message in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main([*args, "--fine-tune", "--epochs", "1", "--out", str(tmp_path / "deep")]) == 0
    assert "2 members keeping every head" in capsys.readouterr().err
    hydra, members = load_any(str(tmp_path / "deep" / "hydra")), load_any(str(tmp_path / "deep" / "members"))
    assert isinstance(members, DeepEnsemble) and hydra.num_members == 2
    every_head = he.HeadSet.full(he.surgery.original_heads_per_layer(load_any(str(w / "model"))))
    for member in members.members:  # every head kept, and the members differ (their seeds)
        assert he.surgery.kept_heads(member) == every_head
    first, second = (dict(m.named_parameters()) for m in members.members)
    assert any(not torch.equal(first[k], second[k]) for k in first)
    _assert_predicts_as_its_members(w, hydra, members)
    saved = saved_calibration(hydra)
    assert saved is not None and saved.flag.statistics is not None and saved_calibration(members) is not None
    # exported on one family (each export costs seconds in torch's exporter): the fused LoRA
    # ensemble is exported on the other
    _served_alike(w, tmp_path, tmp_path / "deep" / "hydra", common, "fp32", export=_family(w) == "bert")


@pytest.mark.same_in_every_precision  # built, predicted, served and exported in fp32, as asked
def test_build_with_lora_members_and_no_head_pruned_is_a_fused_lora_ensemble(workspace, tmp_path, capsys):
    """--num-pruned 0 --fine-tune --lora-rank 2: members whose merged LoRA adapters changed W_Q,
    W_V and their task heads only (every other weight the base's), fused into one model that
    runs what they share once, with one weight, and predicts what their explicit ensemble
    predicts."""
    w, common = workspace, ["--batch-size", "8", "--max-length", "12", "--precision", "fp32"]
    args = ["build", str(w / "model"), "--members", "2", "--num-pruned", "0", "--fine-tune"]
    args += ["--lora-rank", "2", "--data", str(w / "train.csv"), "--val-data", str(w / "train.csv")]
    args += ["--epochs", "1", "--lr", "1e-2"]
    assert main([*args, *common, "--out", str(tmp_path / "lora")]) == 0
    hydra, members = load_any(str(tmp_path / "lora" / "hydra")), load_any(str(tmp_path / "lora" / "members"))
    base = dict(load_any(str(w / "model")).named_parameters())
    adapter = he.adapters.get_adapter(members.members[0])
    q_path, _, v_path, _ = adapter.projection_paths
    changed = (
        q_path.rpartition(".")[2],
        v_path.rpartition(".")[2],
        *adapter.task_head_modules(members.members[0]),
    )
    for member in members.members:
        for name, value in member.named_parameters():
            if not any(part in name.split(".") for part in changed):
                assert torch.equal(value, base[name]), name  # frozen: the base's
    first, second = (dict(m.named_parameters()) for m in members.members)
    assert any(not torch.equal(first[k], second[k]) for k in first if q_path.rpartition(".")[2] in k)
    from hydra_ensembles.layers import GroupedLinear

    # what the members share (the base's MLPs, embeddings, norms) is one module run with one weight;
    # only attention (fused) and the task heads are per member
    grouped = [path for path, module in hydra.named_modules() if isinstance(module, GroupedLinear)]
    heads = adapter.task_head_modules(members.members[0])
    assert grouped and all(path.rpartition(".")[2] in heads for path in grouped), grouped
    _assert_predicts_as_its_members(w, hydra, members)
    # exported on one family: the fused deep ensemble is exported on the other
    _served_alike(w, tmp_path, tmp_path / "lora" / "hydra", common, "fp32", export=_family(w) == "distilbert")
