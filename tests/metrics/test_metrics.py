"""Every metric cross-checked against scikit-learn or torchmetrics on the same arrays."""

import re
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, log_loss, roc_auc_score, roc_curve
from torchmetrics.functional.classification import (
    binary_auroc,
    binary_average_precision,
    multiclass_calibration_error,
)

import hydra_ensembles as he
from hydra_ensembles import metrics
from hydra_ensembles import metrics as M
from hydra_ensembles.metrics import bootstrap


def _random_probs(seed: int, n: int = 200, c: int = 5, sharpness: float = 3.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, c)) * sharpness
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    labels = rng.integers(0, c, size=n)
    return probs, labels


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 300), st.integers(2, 7))
def test_classification_metrics_match_references(seed, n, c):
    probs, labels = _random_probs(seed, n, c)
    # torchmetrics bins float32 confidences: one within float32 rounding of a bin edge k/15 can
    # land in the next bin there (ours bins the float64 value: see the next test)
    edges = np.arange(16) / 15
    assume(np.abs(probs.max(-1)[:, None] - edges).min() > 1e-7)
    got = he.metrics.classification(probs, labels)
    assert got["acc"] == pytest.approx((probs.argmax(-1) == labels).mean())
    assert got["nll"] == pytest.approx(log_loss(labels, probs, labels=list(range(c))), rel=1e-6)
    onehot = np.eye(c)[labels]
    assert got["brier"] == pytest.approx(((probs - onehot) ** 2).sum(-1).mean())
    reference_ece = multiclass_calibration_error(
        torch.tensor(probs, dtype=torch.float64), torch.tensor(labels), num_classes=c, n_bins=15, norm="l1"
    ).item()
    assert got["ece"] == pytest.approx(reference_ece, abs=1e-6)
    assert 0 <= got["aece"] <= 1


def test_ece_bins_a_confidence_just_below_an_edge_by_its_own_value():
    below = np.nextafter(8 / 15, 0.0)  # in float32 it would round onto the edge 8/15
    probs = np.array([[below, 1 - below], [0.55, 0.45]])
    # bin 7 holds the first input (correct), bin 8 the second (wrong); binned together (float32
    # binning) the gap would be 2/2 * |0.5 - (below + 0.55) / 2| = 0.042 instead of 0.508
    expected = 0.5 * abs(1 - below) + 0.5 * abs(0 - 0.55)
    assert M.ece(probs, [0, 1]) == pytest.approx(expected, abs=1e-12)


def test_adaptive_ece_equal_mass_bins_by_hand():
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.7, 0.3]])
    labels = np.array([0, 1, 0, 0])
    # sorted confidences 0.6, 0.7 | 0.8, 0.9 with correctness 1, 1 | 0, 1 (2 bins of 2)
    expected = 0.5 * abs(1 - 0.65) + 0.5 * abs(0.5 - 0.85)
    assert M.adaptive_ece(probs, labels, n_bins=2) == pytest.approx(expected)


def test_perfectly_calibrated_and_confident():
    probs = np.eye(3)[[0, 1, 2, 0]]
    got = M.classification(probs, [0, 1, 2, 0])
    assert got == pytest.approx(
        {"acc": 1.0, "nll": 0.0, "brier": 0.0, "ece": 0.0, "aece": 0.0, "aurc": 0.0}, abs=1e-9
    )


def test_aurc_is_the_mean_selective_risk_written_out():
    """Answer the most confident first: the risk among the first k, averaged over k."""
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    labels = [0, 1, 1, 0]  # wrong: the second and the fourth
    # order by confidence 0.9, 0.8, 0.7, 0.55: errors 0, 1, 0, 1 -> risks 0, 1/2, 1/3, 2/4
    assert M.aurc(probs, labels) == pytest.approx(np.mean([0, 1 / 2, 1 / 3, 2 / 4]))
    probs = np.array([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.55, 0.45]])  # all predict class 0
    least_confident_wrong, most_confident_wrong = [0, 0, 0, 1], [1, 0, 0, 0]  # same accuracy
    assert M.aurc(probs, least_confident_wrong) < M.aurc(probs, most_confident_wrong)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 80), st.integers(1, 80), st.booleans())
@example(seed=281, n_id=20, n_ood=65, ties=True)  # the first threshold at TPR >= 95% lies on a line
def test_ood_metrics_match_references(seed, n_id, n_ood, ties):
    rng = np.random.default_rng(seed)
    id_scores, ood_scores = rng.normal(size=n_id), rng.normal(0.7, size=n_ood)
    if ties:  # coarse scores make many ties
        id_scores, ood_scores = np.round(id_scores), np.round(ood_scores)
    got = he.metrics.ood(id_scores, ood_scores)
    scores = np.concatenate([id_scores, ood_scores])
    labels = np.concatenate([np.zeros(n_id), np.ones(n_ood)])
    assert got["auroc"] == pytest.approx(roc_auc_score(labels, scores))
    s, y = torch.tensor(scores), torch.tensor(labels, dtype=torch.long)
    assert got["auroc"] == pytest.approx(binary_auroc(s, y).item(), abs=1e-6)
    assert got["aupr_out"] == pytest.approx(binary_average_precision(s, y).item(), abs=1e-6)
    assert got["aupr_in"] == pytest.approx(average_precision_score(1 - labels, -scores))
    # every threshold: by default roc_curve drops those on a straight line between others, and
    # the first to reach 95% TPR can be one of them
    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    assert got["fpr95"] == pytest.approx(fpr[np.argmax(tpr >= 0.95)])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 40), st.integers(1, 30), st.booleans())
def test_resampled_ood_is_ood_on_each_resample(seed, n_id, n_ood, resamples, ties):
    """Every resample's four metrics at once equal `ood` (held to scikit-learn above) on that
    resample, the resamples split into blocks or not."""
    rng = np.random.default_rng(seed)
    id_scores, ood_scores = rng.normal(size=n_id), rng.normal(0.5, size=n_ood)
    if ties:
        id_scores, ood_scores = np.round(id_scores), np.round(ood_scores)
    ids, oods = M.resample_indices(n_id, resamples, seed), M.resample_indices(n_ood, resamples, seed, "o")
    rows = [M.ood(id_scores[i], ood_scores[o]) for i, o in zip(ids, oods, strict=True)]
    expected = {key: [row[key] for row in rows] for key in rows[0]}
    got = M.resampled_ood(id_scores, ood_scores, ids, oods)
    assert got == {key: pytest.approx(values, abs=1e-12) for key, values in expected.items()}
    with patch.object(bootstrap, "BLOCK", 1):  # one resample a block
        blocks = M.resampled_ood(id_scores, ood_scores, ids, oods)
    assert blocks == {key: pytest.approx(values, abs=1e-12) for key, values in expected.items()}
    tpr = rng.uniform(0.05, 1.0)
    first = M.fpr_at_tpr(id_scores[ids[0]], ood_scores[oods[0]], tpr)
    assert M.resampled_ood(id_scores, ood_scores, ids, oods, tpr)["fpr95"][0] == first
    values = rng.normal(size=n_id)
    with patch.object(bootstrap, "BLOCK", 2 * n_id):
        assert M.resampled_mean(values, ids) == pytest.approx([values[i].mean() for i in ids])


@pytest.mark.parametrize(
    ("id_draws", "ood_draws", "message"),
    [
        (np.zeros((2, 3), dtype=int), np.zeros((3, 3), dtype=int), "id_draws has 2 resamples, ood_draws 3"),
        (np.full((2, 3), 3), np.zeros((2, 3), dtype=int), "id_draws holds indices outside 0..2"),
        (np.zeros((2, 3), dtype=int), np.full((2, 3), -1), "ood_draws holds indices outside 0..3"),
        (np.zeros(3, dtype=int), np.zeros((2, 3), dtype=int), "id_draws must be a non-empty 2-D array"),
        (np.zeros((2, 3)), np.zeros((2, 3), dtype=int), "id_draws must be a non-empty 2-D array"),
    ],
)
def test_resampled_ood_refuses_draws_that_are_no_resamples(id_draws, ood_draws, message):
    with pytest.raises(he.InputError, match=re.escape(message)):
        M.resampled_ood(np.zeros(3), np.ones(4), id_draws, ood_draws)


def test_resampled_mean_refuses_draws_outside_the_values():
    with pytest.raises(he.InputError, match=re.escape("draws holds indices outside 0..2")):
        M.resampled_mean(np.zeros(3), np.full((2, 3), 3))


def test_fpr95_by_hand_and_positive_class():
    assert M.POSITIVE_CLASS == "OOD"
    # catching both OOD samples needs threshold 0.25: one of three ID samples (0.3) is flagged
    assert M.fpr_at_tpr([0.1, 0.2, 0.3], [0.25, 0.9]) == pytest.approx(1 / 3)
    assert M.ood([0.0, 0.1], [0.9, 1.0])["auroc"] == 1.0


def test_constant_scores_are_chance():
    got = M.ood(np.zeros(10), np.zeros(7))
    assert got["auroc"] == pytest.approx(0.5)
    assert got["fpr95"] == pytest.approx(1.0)


def test_scores():
    probs = np.array([[0.7, 0.2, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    assert M.msp_score(probs) == pytest.approx([0.3, 2 / 3])
    entropy = M.entropy_score(probs)
    assert entropy[1] == pytest.approx(np.log(3)) and entropy[0] < entropy[1]
    logits = np.array([[2.0, 0.0], [0.0, 0.0]])
    assert M.max_logit_score(logits) == pytest.approx([-2.0, 0.0])
    assert M.energy_score(logits) == pytest.approx(-np.log(np.exp(logits).sum(-1)))
    assert torch.allclose(
        torch.tensor(M.energy_score(logits)), -torch.logsumexp(torch.tensor(logits), -1), atol=1e-12
    )


def test_diversity():
    agree = np.stack([np.eye(3)[[0, 1]]] * 3)  # (M=3, N=2, C=3), identical members
    assert M.diversity(agree) == pytest.approx({"mutual_information": 0.0, "disagreement": 0.0}, abs=1e-9)
    split = np.stack([np.eye(2)[[0]], np.eye(2)[[1]]])  # two confident members disagreeing
    got = M.diversity(split)
    assert got["disagreement"] == 1.0
    assert got["mutual_information"] == pytest.approx(np.log(2), abs=1e-6)
    assert M.diversity(agree[:1])["disagreement"] == 0.0


def test_torch_inputs_work():
    probs, labels = _random_probs(0, 50, 3)
    assert M.classification(torch.tensor(probs), torch.tensor(labels)) == pytest.approx(
        M.classification(probs, labels)
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: M.classification(np.full((2, 2), np.nan), [0, 1]), "NaN"),
        (lambda: M.classification(np.ones(3), [0, 1, 2]), "2 dimension"),
        (lambda: M.classification(np.eye(2), [0, 1, 1]), "3 entries"),
        (lambda: M.classification(np.eye(2), [0, 2]), r"\[0, 1\]"),
        (lambda: M.classification(np.eye(2), [0, 0.5]), "integers"),
        (lambda: M.classification(np.eye(2) * 2, [0, 1]), "probabilities"),
        (lambda: M.ood([], [1.0]), "empty"),
        (lambda: M.ood([[1.0]], [1.0]), "1 dimension"),
        (lambda: M.ood([np.inf], [1.0]), "NaN or infinite"),
        (lambda: M.diversity(np.ones((2, 2))), "3 dimension"),
    ],
)
def test_bad_inputs_give_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_single_class_present_in_labels_is_fine():
    probs = np.array([[0.6, 0.4], [0.9, 0.1]])
    got = M.classification(probs, [0, 0])
    assert got["acc"] == 1.0 and got["ece"] == pytest.approx(abs(1 - 0.75))


# --------------------------------------------------------------------------- guards
@pytest.mark.parametrize("n_bins", [0, -3, 2.5, True, None])
def test_bin_counts_must_be_positive_integers(n_bins):
    probs, labels = np.array([[0.9, 0.1], [0.4, 0.6]]), np.array([0, 0])
    for metric in (metrics.ece, metrics.adaptive_ece):
        with pytest.raises(ValueError, match="n_bins must be an integer >= 1"):
            metric(probs, labels, n_bins=n_bins)


@pytest.mark.parametrize("tpr", [0, -0.1, 1.5, float("nan"), float("inf")])
def test_fpr_at_tpr_refuses_impossible_rates(tpr):
    with pytest.raises(ValueError, match="tpr must lie in"):
        metrics.fpr_at_tpr([0.1, 0.2, 0.3], [0.5, 0.6], tpr=tpr)
    assert metrics.fpr_at_tpr([0.1, 0.2, 0.3], [0.5, 0.6], tpr=1.0) == 0.0


def test_probability_scores_refuse_logits():
    logits = np.array([[2.0, -1.0], [0.5, 3.0]])
    for score in (metrics.msp_score, metrics.entropy_score):
        with pytest.raises(ValueError, match="must be probabilities"):
            score(logits)
    with pytest.raises(ValueError, match="must be probabilities"):
        metrics.mutual_information_score(logits[None])


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"n_resamples": 0}, "n_resamples"), ({"level": 1.0}, "level")]
)
def test_bootstrap_refuses_empty_or_degenerate_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        metrics.bootstrap_ci(np.array([[0.9, 0.1], [0.4, 0.6]]), np.array([0, 1]), **kwargs)


def test_ece_binning_differs_from_torchmetrics_only_at_confidence_one():
    from torchmetrics.functional.classification import multiclass_calibration_error

    def both(probs, labels):
        ours = metrics.ece(np.array(probs), np.array(labels))
        theirs = multiclass_calibration_error(
            torch.tensor(probs), torch.tensor(labels), num_classes=2, n_bins=15, norm="l1"
        ).item()
        return ours, theirs

    ours, theirs = both([[1.0, 0.0], [0.95, 0.05]], [1, 0])
    assert ours == pytest.approx(0.475) and theirs == pytest.approx(0.525, abs=1e-6)
    ours, theirs = both([[0.2, 0.8], [0.6, 0.4], [0.7, 0.3]], [1, 1, 0])
    assert ours == pytest.approx(theirs, abs=1e-6)
