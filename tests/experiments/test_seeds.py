"""Multi-seed demo summaries: mean ± std of the main metrics over seeds."""

import numpy as np
import pytest

from hydra_ensembles.reporting import seeds_table
from hydra_experiments import DemoConfig, run_seeds, seed_summary


def _row(acc: float, auroc: float) -> dict:
    classification = {"acc": acc, "nll": 1 - acc, "brier": 0.1, "ece": 0.05, "aece": 0.04}
    average = {"auroc": auroc, "fpr95": 0.5, "aupr_in": 0.9, "aupr_out": 0.4}
    return {"classification": classification, "ood_summary": {"msp": {"average": average}}}


def test_seed_summary_is_mean_and_sample_std_of_methods_in_every_seed():
    per_seed = {
        0: {"Single": _row(0.80, 0.70), "Hydra (Circ)": _row(0.82, 0.75), "only here": _row(0.5, 0.5)},
        1: {"Single": _row(0.84, 0.72), "Hydra (Circ)": _row(0.83, 0.79)},
        2: {"Single": _row(0.83, 0.71), "Hydra (Circ)": _row(0.87, 0.77)},
    }
    summary = seed_summary(per_seed)
    assert list(summary) == ["Single", "Hydra (Circ)"]
    mean, std, n = summary["Hydra (Circ)"]["auroc"]
    assert (mean, std, n) == pytest.approx(
        (np.mean([0.75, 0.79, 0.77]), np.std([0.75, 0.79, 0.77], ddof=1), 3)
    )
    table = seeds_table(summary, [0, 1, 2], "hydra-ens demo")
    assert "| Hydra (Circ) | msp, msp, msp | 84.00 ± 2.65 |" in table and "--seeds 0,1,2" in table
    assert "| Hydra (Circ) | 77.00 ± 2.00 |" in table.split("AUROC ↑ by score")[1]  # every score's


@pytest.mark.parametrize("seeds", [[0], [1, 1]])
def test_seeds_must_be_at_least_two_distinct(seeds, tmp_path):
    with pytest.raises(ValueError, match="at least two distinct seeds"):
        run_seeds(DemoConfig(out_dir=tmp_path), seeds)
    assert not list(tmp_path.iterdir())


def test_model_seeds_differ_between_runs_and_keep_seed_zero():
    assert [DemoConfig(seed=0).model_seed(i) for i in range(3)] == [0, 1, 2]
    assert DemoConfig(seed=1).model_seed(0) == 100
