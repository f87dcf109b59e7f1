"""hydra-ens sweep on a small local model and CSV data: the frontier table and plot, the measures
against explicit computation on the held-out half, the budget's choice saved and served, a kill
and a resume that give the same measures, and one-line refusals that write nothing."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.data import load_spec, split_indices, to_batches
from hydra_ensembles.errors import InputError
from hydra_ensembles.evaluation import predict
from hydra_ensembles.loading import load_any, load_preprocessor
from hydra_ensembles.metrics import classification
from hydra_ensembles.sweep import SINGLE, SweepConfig, choose, frontier, verdict
from tests.cli.test_interruption import child, killed_at_step
from tests.cli.test_pipeline import _model_and_tokenizer

# one pytest-xdist worker: the module's model and finished sweep are built once, not once per worker
pytestmark = pytest.mark.xdist_group("sweep")

COMMON = ["--batch-size", "8", "--max-length", "12"]
QUALITY = ("name", "acc", "nll", "nll_t1", "ece", "flag_score", "auroc", "fpr95", "id_flagged", "set_size")


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    _model_and_tokenizer("bert", root / "model")
    rows = [f"goal match team score {i},sport" for i in range(16)]
    rows += [f"bank shares market profit {i},money" for i in range(16)]
    (root / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    rows = [f"team goal player win {i},sport" for i in range(20)]
    rows += [f"market bank loan rate {i},money" for i in range(20)]
    (root / "val.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    (root / "ood.csv").write_text("text\n" + "\n".join(f"recipe with flour {i}" for i in range(20)) + "\n")
    score = ["score", str(root / "model"), "--method", "taylor", "--data", str(root / "train.csv")]
    assert main([*score, "--heads-per-layer", "2", "--out", str(root / "taylor.json"), *COMMON]) == 0
    return root


def one_error(capsys) -> str:
    """The one error line a refused command printed (loading progress bars aside)."""
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    return errors[0]


def sweep_args(w: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sweep", str(w / "model"), "--scores", str(w / "taylor.json"), "--members", "2",
        "--num-pruned", "2,3", "--data", str(w / "train.csv"), "--val-data", str(w / "val.csv"),
        "--ood-data", str(w / "ood.csv"), "--flag-score", "mds", "--keep", "0.8", "--fine-tune",
        "--epochs", "2", "--lr", "1e-3", "--batch-sizes", "1,8", "--repeats", "2", "--out", str(out),
        *COMMON, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def swept(w):
    out = w / "swept"
    assert main(sweep_args(w, out, "--keep-base", "--budget", "50")) == 0
    return out


def test_sweep_writes_every_configuration_its_frontier_and_the_choice(swept):
    result = json.loads((swept / "sweep.json").read_text())
    rows = result["rows"]
    names = [r["name"] for r in rows]
    assert names == [SINGLE, "hydra-m2-p2-t0", "hydra-m2-p2-t0-base", "hydra-m2-p3-t0", "hydra-m2-p3-t0-base"]
    assert rows[0]["latency_ratio@1"] == rows[0]["latency_ratio@8"] == 1.0
    assert [r["frontier"] for r in rows] == frontier(rows)
    assert result["chosen"] == choose(rows, 50)
    for row in rows[1:]:  # paired differences from the single model, on the same held-out inputs
        for metric in ("auroc", "nll"):
            assert row[f"{metric}_vs_single"] == pytest.approx(row[metric] - rows[0][metric], abs=1e-9)
            assert row[f"{metric}_vs_single_low"] <= row[f"{metric}_vs_single_high"]
    assert (swept / "frontier.png").stat().st_size > 1000
    table = (swept / "sweep.md").read_text()
    assert all(name in table for name in names) and "(chosen)" in table
    assert (swept / "sweep.csv").read_text().splitlines()[0].startswith("name,")
    assert not (swept / "configs" / "hydra-m2-p2-t0" / "checkpoints").exists()


def test_sweep_measures_are_those_of_the_saved_models_on_the_held_out_half(w, swept):
    """Accuracy, NLL at temperature 1 and as served, recomputed by hand on the held-out half."""
    dataset = load_spec(str(w / "val.csv"))
    held = dataset.subset(split_indices(dataset.ids, {"fit": 0.5, "held": 0.5}, salt="sweep")["held"])
    rows = {r["name"]: r for r in json.loads((swept / "sweep.json").read_text())["rows"]}
    for name, folder in (
        (SINGLE, "configs/single/model"),
        ("hydra-m2-p3-t0", "configs/hydra-m2-p3-t0/build/hydra"),
    ):
        model = load_any(str(swept / folder))
        batches = list(to_batches(held, load_preprocessor(str(swept / folder)), 8, 12))
        preds = predict(model, batches, progress=False)
        labels = np.asarray(held.labels)
        temperature = saved_calibration(model).temperature
        assert rows[name]["temperature"] == pytest.approx(temperature)
        for key, t in (("nll_t1", 1.0), ("nll", temperature)):
            expected = classification(preds.probs(t), labels)["nll"]
            assert rows[name][key] == pytest.approx(expected, rel=1e-5), (name, key)
        assert rows[name]["acc"] == pytest.approx(
            float((preds.probs(temperature).argmax(1) == labels).mean())
        )


def test_the_chosen_configuration_is_saved_whole_and_predicts_as_its_own_folder(w, swept, tmp_path):
    rows = json.loads((swept / "sweep.json").read_text())
    name = rows["rows"][rows["chosen"]]["name"]
    folder = "configs/single/model" if name == SINGLE else f"configs/{name}/build/hydra"
    for path in (swept / "chosen", swept / folder):
        out = tmp_path / f"{path.name}.csv"
        assert main(["predict", str(path), "--data", str(w / "val.csv"), "--out", str(out), *COMMON]) == 0
    assert (tmp_path / "chosen.csv").read_text() == (tmp_path / f"{(swept / folder).name}.csv").read_text()


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_a_killed_sweep_resumes_to_the_same_measures(w, tmp_path):
    straight = tmp_path / "straight"  # in a new process too: the same threads as the resumed run's
    done = child(f"sys.exit(main({sweep_args(w, straight)!r}))")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "resumed"
    # the single model and the first build's member 0 done (2 epochs of 4 steps); member 1 started
    killed = killed_at_step(2 * 4 + 2, sweep_args(w, out))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "configs" / SINGLE / "result.json").is_file() and not (out / "sweep.json").exists()
    resumed = child(f"sys.exit(main({sweep_args(w, out)!r}))")
    assert resumed.returncode == 0, resumed.stderr
    assert "finished earlier, kept" in resumed.stderr
    first, again = (json.loads((p / "sweep.json").read_text())["rows"] for p in (straight, out))
    assert [{k: r[k] for k in QUALITY} for r in again] == [{k: r[k] for k in QUALITY} for r in first]


@pytest.mark.same_in_every_precision  # what a rerun redoes and keeps: no precision changes it
def test_a_finished_sweep_run_again_with_a_budget_only_times_and_chooses(w, tmp_path, capsys):
    out = tmp_path / "again"
    assert main(sweep_args(w, out)) == 0
    assert not (out / "chosen").exists()
    before = (out / "configs" / "hydra-m2-p3-t0" / "result.json").read_bytes()
    assert main(sweep_args(w, out, "--budget", "50")) == 0
    assert capsys.readouterr().err.count("finished earlier, kept") == 3
    assert json.loads((out / "sweep.json").read_text())["chosen"] is not None and (out / "chosen").is_dir()
    assert (out / "configs" / "hydra-m2-p3-t0" / "result.json").read_bytes() == before
    assert main(sweep_args(w, out)) == 0  # no budget now: no stale choice is left
    assert not (out / "chosen").exists()
    capsys.readouterr()
    wider = sweep_args(w, out)
    wider[wider.index("--num-pruned") + 1] = "2,3,1"  # a wider grid: only the new build is made
    assert main(wider) == 0
    assert capsys.readouterr().err.count("finished earlier, kept") == 3
    assert [r["name"] for r in json.loads((out / "sweep.json").read_text())["rows"]][-1] == "hydra-m2-p1-t0"
    assert (out / "configs" / "hydra-m2-p3-t0" / "result.json").read_bytes() == before
    assert main(sweep_args(w, out, "--lr", "2e-3")) == 2  # other settings: refused without --overwrite
    assert "already holds a result" in one_error(capsys)


def test_sweep_refusals_are_one_line_and_write_nothing(w, tmp_path, capsys):
    out = tmp_path / "refused"
    untrained = [a for a in sweep_args(w, out, "--bootstrap") if a != "--fine-tune"]
    assert main(untrained) == 2
    assert "--bootstrap resamples" in one_error(capsys)
    for option, value in (("--budget", "0.5"), ("--members", "1"), ("--num-pruned", "2,x")):
        with pytest.raises(SystemExit):
            main(sweep_args(w, out, option, value))
        assert option in one_error(capsys)
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("text,label\ngoal,sport\nbank,money\n")
    args = sweep_args(w, out)
    args[args.index("--val-data") + 1] = str(tiny)
    assert main(args) == 2
    assert "too few to split" in one_error(capsys)
    assert not out.exists()


@pytest.mark.same_in_every_precision
def test_a_link_planted_where_the_sweep_saves_its_choice_is_refused(w, swept, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out = tmp_path / "planted"
    killed = killed_at_step(2 * 4 + 2, sweep_args(w, out, "--budget", "50"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (out / "chosen").symlink_to(elsewhere, target_is_directory=True)
    assert main(sweep_args(w, out, "--budget", "50")) == 2
    assert "link" in capsys.readouterr().err
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]


def test_sweep_config_checks_its_grid_and_leaves_out_what_build_refuses():
    config = SweepConfig(members=(2, 3), num_pruned=(4,), shared_layers=(0, 1), keep_base=(False, True))
    names = [c.name for c in config.candidates()]
    assert names == [SINGLE, "hydra-m2-p4-t0", "hydra-m2-p4-t0-base", "hydra-m2-p4-t1",
                     "hydra-m3-p4-t0", "hydra-m3-p4-t0-base", "hydra-m3-p4-t1"]  # fmt: skip
    for bad in ({"num_pruned": ()}, {"num_pruned": (4, 4)}, {"members": (1,)}, {"budget": 0.5},
                {"num_pruned": (4,), "repeats": 0}):  # fmt: skip
        with pytest.raises(InputError):
            SweepConfig(**{"num_pruned": (4,), **bad})


def _row(name, cost, auroc, nll, auroc_ci=(0.0, 0.0), nll_ci=(0.0, 0.0)):
    """A sweep row with paired 95% intervals of its differences from the single model (row 0)."""
    out = {"name": name, "latency_ratio": cost, "auroc": auroc, "nll": nll}
    for metric, (low, high) in (("auroc", auroc_ci), ("nll", nll_ci)):
        out[f"{metric}_vs_single"], out[f"{metric}_vs_single_low"] = (low + high) / 2, low
        out[f"{metric}_vs_single_high"] = high
    return out


def test_frontier_and_choice_by_hand():
    """A candidate replaces the single model only where it is significantly better on the measure
    preferred and significantly worse on no other; a gain inside the noise keeps the single model."""
    rows = [
        _row("single", 1.0, 0.90, 0.30),
        _row("b", 1.4, 0.93, 0.25, (0.01, 0.05), (-0.1, 0.0)),
        _row("c", 1.6, 0.92, 0.20, (0.01, 0.03), (-0.2, -0.1)),
        _row("d", 2.5, 0.95, 0.28, (0.02, 0.08), (-0.1, 0.1)),
        _row("e", 1.4, 0.93, 0.22, (0.01, 0.05), (-0.1, 0.0)),
        _row("f", 1.1, 0.96, 0.40, (0.03, 0.09), (0.02, 0.2)),
        _row("g", 1.05, 0.97, 0.29, (-0.01, 0.13), (-0.1, 0.1)),
    ]
    assert frontier(rows) == [True, False, False, False, False, False, True]  # g is cheaper and better
    # f is the best AUROC within 1.5x but significantly worse on NLL; g's gain is noise: e wins
    assert choose(rows, 1.5) == 4 and choose(rows, 3) == 3
    assert choose(rows, 1.2) == 0  # only f and g within the budget: the single model is kept
    assert "the single model is kept" in verdict(rows, 0, 1.2) and "g: flag AUROC" in verdict(rows, 0, 1.2)
    assert verdict(rows, 4, 1.5).startswith("e is chosen within 1.5x: significantly better")
    assert choose(rows, 1.5, prefer="nll") == 0 and choose(rows, 2.0, prefer="nll") == 2
    with pytest.raises(InputError, match="raise --budget"):
        choose(rows, 0.9)
    no_ood = [{k: v for k, v in r.items() if not k.startswith("auroc")} | {"auroc": None} for r in rows]
    assert choose(no_ood, 2.0) == 2  # without OOD data: significantly lower NLL
    with pytest.raises(InputError, match="--ood-data"):
        choose(no_ood, 2.0, prefer="auroc")
    assert frontier(rows, quality="nll") == frontier(no_ood)  # the NLL panel's frontier, with OOD data


def test_a_compared_deep_ensemble_is_measured_beside_and_a_taken_name_refused(w, tmp_path, capsys):
    """Two copies of the model as a deep ensemble: the same probabilities as the model, so the
    same NLL at temperature 1, measured as an ensemble of two; a name the grid takes is refused."""
    out = tmp_path / "compared"
    model = str(w / "model")
    args = sweep_args(w, out, "--compare", f"copies={model},{model}")
    args[args.index("--num-pruned") + 1] = "2"
    assert main(args) == 0
    rows = {r["name"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    assert list(rows) == [SINGLE, "copies", "hydra-m2-p2-t0"]
    assert rows["copies"]["members"] == 2 and rows[SINGLE]["members"] == 1
    assert rows["copies"]["nll_t1"] == pytest.approx(rows[SINGLE]["nll_t1"], rel=1e-6)
    assert (out / "configs" / "copies" / "model" / "ensemble_config.json").is_file()
    refused = tmp_path / "refused"
    assert main(sweep_args(w, refused, "--compare", f"hydra-m2-p2-t0={model}")) == 2
    assert "named like a configuration" in one_error(capsys) and not refused.exists()
    assert main(sweep_args(w, refused, "--compare", f"../up={model}")) == 2
    assert "letters, digits" in one_error(capsys) and not refused.exists()


def test_a_candidate_is_made_again_when_what_it_is_made_of_changes(monkeypatch):
    from transformers import BertConfig, BertForSequenceClassification

    from hydra_ensembles.build import BuildConfig
    from hydra_ensembles.hashing import fingerprint
    from hydra_ensembles.sweep import Candidate
    from hydra_ensembles.sweep.run import identity

    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    one, two = BertForSequenceClassification(config), BertForSequenceClassification(config)
    base = fingerprint(one)
    compared = Candidate("theirs")
    assert identity(compared, base, {"theirs": one}) != identity(compared, base, {"theirs": two})
    built = Candidate("hydra-m2-p2-t0", BuildConfig(num_members=2, num_pruned=2))
    other = Candidate("hydra-m2-p2-t0", BuildConfig(num_members=2, num_pruned=2, seed=1))
    assert identity(built, base, {}) != identity(other, base, {})
    assert identity(built, base, {}) != identity(built, fingerprint(two), {})
    assert identity(built, base, {}) == identity(built, base, {})
    # a library offering another OOD score measures every candidate again (same detectors for all)
    before = {c.name: identity(c, base, {"theirs": one}) for c in (compared, built, Candidate("single"))}
    from hydra_ensembles.sweep import run

    monkeypatch.setattr(run, "ood_score_names", lambda: ("msp", "mds", "a_new_score"))
    after = {c.name: identity(c, base, {"theirs": one}) for c in (compared, built, Candidate("single"))}
    assert all(before[name] != after[name] for name in before)


def _finished_copy(swept: Path, tmp_path: Path) -> Path:
    """A copy of the finished sweep (its run marker names no folder: the copy is the same sweep)."""
    import shutil

    out = tmp_path / "finished"
    shutil.copytree(swept, out, symlinks=True)
    return out


def _plant_link(out: Path, tmp_path: Path) -> Path:
    """``configs/single`` replaced by a link to an edited copy outside the sweep (its measures
    raised): whoever can write into OUT would choose the model a user deploys."""
    import shutil

    outside = tmp_path / "outside-single"
    shutil.copytree(out / "configs" / SINGLE, outside)
    result = json.loads((outside / "result.json").read_text())
    (outside / "result.json").write_text(json.dumps({**result, "acc": 0.999, "auroc": 0.999}))
    shutil.rmtree(out / "configs" / SINGLE)
    (out / "configs" / SINGLE).symlink_to(outside, target_is_directory=True)
    return outside


def _plant_deep_link(out: Path, tmp_path: Path) -> Path:
    """A file deep in a kept candidate's model replaced by a link to a copy outside."""
    target = out / "configs" / "hydra-m2-p2-t0" / "build" / "hydra" / "config.json"
    outside = tmp_path / "outside-config.json"
    outside.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(outside)
    return outside


def _plant_in_a_rebuilt_candidate(out: Path, tmp_path: Path) -> Path:
    """A candidate the rerun has to make again (its recorded identity no longer matches) whose
    ``build`` folder is a link to someone's folder: the rebuild must not write or delete there."""
    import shutil

    folder = out / "configs" / "hydra-m2-p3-t0"
    (folder / "identity.json").write_text(json.dumps({"identity": "another build"}))
    outside = tmp_path / "someones-folder"
    outside.mkdir()
    (outside / "mine.txt").write_text("a file the user cares about")
    shutil.rmtree(folder / "build")
    (folder / "build").symlink_to(outside, target_is_directory=True)
    return outside


def _plant_fifo(out: Path, tmp_path: Path) -> Path:
    import os
    import shutil

    shutil.rmtree(out / "chosen")
    os.mkfifo(out / "chosen")
    return out / "chosen"


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (_plant_link, "is a symbolic link"),
        (_plant_deep_link, "is a symbolic link"),
        (_plant_in_a_rebuilt_candidate, "is a symbolic link"),
        (_plant_fifo, "is a FIFO"),
    ],
    ids=[
        "kept-candidate-linked",
        "file-deep-in-a-kept-model-linked",
        "rebuilt-candidate-linked",
        "chosen-a-fifo",
    ],
)
def test_what_is_planted_in_a_finished_sweep_is_refused_before_anything_is_read_or_replaced(
    w, swept, tmp_path, capsys, plant, said
):
    """A rerun of a finished sweep reads back its candidates' models and measures: a link or a
    FIFO planted anywhere in its folder is refused in one line before any timing, and the sweep's
    published files, and whatever the link points to, are left as they were."""
    out = _finished_copy(swept, tmp_path)
    outside = plant(out, tmp_path)
    published = {name: (out / name).read_bytes() for name in ("sweep.json", "sweep.md", "sweep.csv")}
    before = sorted(p.name for p in outside.iterdir()) if outside.is_dir() else None
    assert main(sweep_args(w, out, "--keep-base", "--budget", "50")) == 2
    assert said in one_error(capsys)
    assert {name: (out / name).read_bytes() for name in published} == published
    if before is not None:
        assert sorted(p.name for p in outside.iterdir()) == before


def _named_model(w: Path, name: str, labels: dict[int, str] | int) -> Path:
    """The sweep's model saved with class names (or another number of classes) at ``w/name``."""
    from transformers import BertForSequenceClassification

    folder = w / name
    if not folder.exists():
        model = load_any(str(w / "model"))
        if isinstance(labels, int):
            config = model.config
            config.num_labels = labels
            model = BertForSequenceClassification(config)
        else:
            model.config.id2label = labels
            model.config.label2id = {v: k for k, v in labels.items()}
        model.save_pretrained(folder)
        load_preprocessor(str(w / "model")).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("theirs", "said"),
    [
        ({0: "sport", 1: "money"}, "the same classes in another order"),
        ({0: "neg", 1: "pos"}, "different classes"),
        (3, "different numbers of classes"),
    ],
    ids=["classes-in-another-order", "other-class-names", "three-classes"],
)
def test_a_compared_model_is_matched_by_class_name_as_eval_matches_it(w, tmp_path, capsys, theirs, said):
    """``--compare`` measures every model against the sweep model's labelling of the data: a
    model naming the same classes in another order, other classes or another number of them is
    refused before any work, with eval's rule and its message."""
    ours = _named_model(w, "named", {0: "money", 1: "sport"})
    other = _named_model(
        w, f"compared-{len(theirs) if isinstance(theirs, dict) else theirs}-{said[:9]}", theirs
    )
    out = tmp_path / "compared"
    args = sweep_args(w, out, "--compare", f"theirs={other}")
    args[1] = str(ours)
    assert main(args) == 2
    line = one_error(capsys)
    assert said in line and "--compare theirs" in line and not out.exists()
    report = tmp_path / "report"
    assert main(["eval", "--method", f"a={ours}", "--method", f"b={other}", "--id-data", str(w / "val.csv"),
                 "--out", str(report), *COMMON]) == 2  # fmt: skip
    assert said in one_error(capsys)


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--flag-score", "mds_disagreement", "the sweep's 'single' candidate"),
        ("--num-pruned", "99", "num_pruned must be in [0, 7]"),
        ("--shared-layers", "5", "shared_layers must be in [0, 1]"),
        ("--shared-layers", "2", "shared_layers must be in [0, 1]"),
    ],
)
def test_every_option_is_checked_against_the_model_before_the_first_candidate_is_made(
    w, tmp_path, capsys, option, value, said
):
    out = tmp_path / "early"
    args = sweep_args(w, out)
    args[args.index(option) + 1 if option in args else len(args) :] = (
        [value, *args[args.index(option) + 2 :]] if option in args else [option, value]
    )
    assert main(args) == 2
    assert said in one_error(capsys)
    assert not out.exists()  # no run marker, no candidate


def test_a_budget_that_is_no_finite_ratio_says_what_to_give(w, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(sweep_args(w, tmp_path / "inf", "--budget", "inf"))
    assert "finite number >= 1" in one_error(capsys)


def test_validation_data_of_one_class_are_refused_before_any_candidate(w, tmp_path, capsys):
    """One class among the inputs that fit the temperature would give every candidate a runaway
    temperature (millions: every probability 1/C); refused, naming the class, before any work."""
    one = tmp_path / "sport-only.csv"
    one.write_text("text,label\n" + "".join(f"team goal player win {i},1\n" for i in range(20)))
    out = tmp_path / "one-class"
    args = sweep_args(w, out)
    args[args.index("--val-data") + 1] = str(one)
    assert main(args) == 2
    assert "of one class" in one_error(capsys) and not out.exists()


@pytest.mark.same_in_every_precision  # which candidates, their multiply-adds and intervals
def test_the_fused_deep_ensemble_and_lora_ensemble_are_candidates_of_the_sweep(w, tmp_path, capsys):
    """--num-pruned 0,3 --lora-rank 2: the fused deep ensemble of fine-tunes (``deep-m2``, every
    head kept, every part per member) and the fused LoRA-Ensemble (``lora-m2-r2``) are measured
    beside the Hydra build and the single model: cost ratio and paired differences from the single
    model; without --fine-tune they are refused in one line."""
    with pytest.raises(InputError, match=r"lora_rank .* needs fine_tune"):
        SweepConfig(num_pruned=(3,), lora_rank=2)
    args = [*sweep_args(w, tmp_path / "deep"), "--lora-rank", "2"]
    args[args.index("--num-pruned") + 1] = "0,3"
    refused = [a for a in args if a != "--fine-tune"]
    refused[refused.index("--out") + 1] = str(tmp_path / "refused")
    assert main(refused) == 2
    assert "needs fine_tune" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main(args) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "deep" / "sweep.json").read_text())["rows"]}
    assert set(rows) == {SINGLE, "deep-m2", "hydra-m2-p3-t0", "lora-m2-r2"}
    for name in ("deep-m2", "lora-m2-r2"):
        row = rows[name]
        assert row["latency_ratio@8"] > 0 and row["auroc_vs_single_low"] <= row["auroc_vs_single_high"]
        assert row["gmacs_per_input"] == pytest.approx(2 * rows[SINGLE]["gmacs_per_input"], rel=0.05)
        fused = load_any(str(tmp_path / "deep" / "configs" / name / "build" / "hydra"))
        assert fused.num_members == 2
    members = list(load_any(str(tmp_path / "deep" / "configs" / "lora-m2-r2" / "build" / "members")).members)
    assert len(members) == 2  # the LoRA members changed only what LoRA trains
    for name, weight in members[0].named_parameters():
        if "intermediate" in name or "embeddings" in name:
            assert torch.equal(weight, dict(members[1].named_parameters())[name]), name
