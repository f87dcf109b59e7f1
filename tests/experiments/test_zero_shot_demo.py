"""The zero-shot demo end to end on the real MiniLM-L6, reduced to a few texts."""

from __future__ import annotations

import json

import pytest

from hydra_experiments import Cache, DemoConfig
from hydra_experiments.zero_shot import run_zero_shot_demo


@pytest.mark.slow  # about 80 s; the same code runs on a tiny encoder in tests/experiments/test_demos_tiny.py
@pytest.mark.real_model
def test_reduced_zero_shot_demo_runs_end_to_end_without_training(tmp_path, capsys):
    config = DemoConfig.preset(
        "zero-shot",
        train_limit=8,
        val_limit=24,
        test_limit=24,
        ood_limit=12,
        shift_limit=4,
        members=2,
        num_pruned=8,
        pool_size=10,
        circuit_budget=10,
        circuit_id_items=4,
        circuit_ood_items=4,
        circuit_length=12,
        max_length=16,
        curve_step=5,
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        bench_repeats=1,
        bootstrap=20,  # the intervals' code path; their width is not what this test checks
    )
    first_cache = Cache(config.cache_dir, True)
    first = run_zero_shot_demo(config, first_cache)
    assert any(entry.startswith("zs-circuit-") for entry in first_cache.built)
    assert "Hydra (Circ, input tower)" in capsys.readouterr().out
    results = first["results"]
    assert list(results) == [
        "Single",
        "Single + TS",
        "Taylor (single pruned)",
        "CircAvg (single pruned)",
        "Hydra (Taylor)",
        "Hydra (Circ)",
        "Hydra (Circ) + TS",
        "Hydra (Circ) + TS per member",
        "Hydra (Circ, input tower)",
    ]
    for method in results.values():
        assert set(method["ood"]) == {"bbc-tech", "drug-reviews", "fortunes"}
        assert 0 <= method["classification"]["acc"] <= 1
    assert results["Single"]["classification"]["acc"] > 0.5  # zero-shot MiniLM knows news topics
    report = (tmp_path / "report" / "report.md").read_text()
    assert "zero-shot benchmark" in report and "no training" in report and "## Cost" in report
    cost = json.loads((tmp_path / "report" / "cost.json").read_text())["methods"]
    assert set(cost) == {"Single", "Hydra (Circ)", "Hydra (Circ, input tower)"}
    assert cost["Single"]["params"] == 22_713_216  # the input tower only: MiniLM-L6 with its pooler
    assert cost["Hydra (Circ)"]["gmacs"] < 2 * cost["Single"]["gmacs"]  # 2 members, 8 of 144 heads pruned
    curves = json.loads((tmp_path / "report" / "pruning_curves.json").read_text())
    assert [n for n, _ in curves["accuracy"]["CircAvg"]] == [0, 5, 8, 10]  # 8: the members' budget
    table = json.loads((tmp_path / "report" / "pruning_table.json").read_text())
    assert table["results"]["Taylor"]["classification"]["acc"] == dict(curves["accuracy"]["Taylor"])[8]

    cache = Cache(config.cache_dir, True)
    second = run_zero_shot_demo(config, cache)
    assert cache.built == []  # every ranking came from the cache
    assert second["results"]["Hydra (Circ)"] == results["Hydra (Circ)"]
