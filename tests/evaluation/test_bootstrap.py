"""Bootstrap draws against metrics recomputed on the same resampled items, and paired
differences that behave as a test should (0 for identical methods, significant for a clearly
better one, narrower than the methods' own intervals when their errors are shared)."""

import numpy as np
import pytest

from hydra_ensembles import metrics as M
from hydra_ensembles.evaluation import (
    Predictions,
    add_comparisons,
    add_intervals,
    bootstrap_draws,
    evaluate_method,
)
from hydra_ensembles.evaluation.run import MethodPredictions


def _method(seed: int, sharp: float = 3.0, n: int = 80, shift: float = 0.0):
    rng = np.random.default_rng(seed)
    labels = np.random.default_rng(0).integers(0, 3, n)
    logits = rng.normal(size=(2, n, 3))
    logits[:, np.arange(n), labels] += sharp  # how confidently right it is
    near = Predictions(rng.normal(size=(2, 30, 3)) + shift)
    far = Predictions(rng.normal(size=(2, 40, 3)) * 0.2)
    return MethodPredictions(Predictions(logits, labels), {"n": ("near", near), "f": ("far", far)}, {})


def test_draws_are_the_metrics_of_the_resampled_items():
    preds = _method(1)
    draws = bootstrap_draws(preds.test, preds.ood, n_resamples=5, seed=3)
    assert set(draws) == {
        "acc",
        "nll",
        "brier",
        "ece",
        "aece",
        "aurc",
        "auroc",
        "fpr95",
        "aupr_in",
        "aupr_out",
    }
    k = 4
    test_index = M.resample_indices(80, 5, 3, "id-test")[k]
    probs, labels = preds.test.probs(), preds.test.labels
    assert draws["nll"][k] == pytest.approx(M.nll(probs[test_index], labels[test_index]))
    id_scores = M.msp_score(probs)[test_index]
    per_set = {}
    for name, (_, p) in preds.ood.items():
        index = M.resample_indices(p.member_logits.shape[1], 5, 3, f"ood:{name}")[k]
        per_set[name] = M.ood(id_scores, M.msp_score(p.probs())[index])
    assert draws["auroc"][k] == pytest.approx((per_set["n"]["auroc"] + per_set["f"]["auroc"]) / 2)


def test_identical_methods_do_not_differ_and_a_better_one_does():
    a, worse = _method(1, sharp=3.0), _method(1, sharp=0.5)
    results, draws = {}, {}
    for name, preds in (("a", a), ("copy", a), ("worse", worse)):
        rows, _, row_draws = evaluate_method(name, preds, bootstrap=300)
        results.update(rows)
        draws.update(row_draws)
    add_comparisons(results, draws, [("a", "copy"), ("a", "worse")])
    same = results["a"]["differences"]["copy"]["nll"]
    assert same == {"difference": 0.0, "low": 0.0, "high": 0.0, "p_value": 1.0}
    better = results["a"]["differences"]["worse"]
    assert better["nll"]["high"] < 0 and better["nll"]["p_value"] < 0.05
    assert better["acc"]["low"] > 0 and better["acc"]["p_value"] < 0.05
    low, high = results["a"]["intervals"]["acc"]
    assert low <= results["a"]["classification"]["acc"] <= high


def test_pairing_cancels_the_shared_item_difficulty():
    a = _method(1, sharp=2.0)
    b = MethodPredictions(Predictions(a.test.member_logits * 1.05, a.test.labels), a.ood, {})
    results, draws = {}, {}
    for name, preds in (("a", a), ("b", b)):
        rows, _, row_draws = evaluate_method(name, preds, bootstrap=300)
        results.update(rows)
        draws.update(row_draws)
    add_comparisons(results, draws, [("b", "a")])
    own = np.diff(results["a"]["intervals"]["nll"])[0]
    paired = results["b"]["differences"]["a"]["nll"]
    assert paired["high"] - paired["low"] < own / 5


def test_intervals_need_a_sensible_level_and_resamples():
    preds = _method(2)
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_draws(preds.test, n_resamples=0)
    draws = {"x": bootstrap_draws(preds.test, n_resamples=10)}
    with pytest.raises(ValueError, match="level"):
        add_intervals({"x": {}}, draws, level=1.0)
