"""In-distribution metrics: accuracy, NLL, Brier, ECE and adaptive ECE (torch-uncertainty style
small classes, plus one function returning them all)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import check_count, check_labels, check_probs
from .bootstrap import percentile_interval, resample_indices

EPS = 1e-12


def accuracy(probs: Any, labels: Any) -> float:
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    return float((p.argmax(-1) == y).mean())


def nll(probs: Any, labels: Any) -> float:
    """Mean negative log-likelihood (natural log) of the true class."""
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    return float(-np.log(np.clip(p[np.arange(len(y)), y], EPS, None)).mean())


def brier(probs: Any, labels: Any) -> float:
    """Sum over classes of (p - onehot)^2, mean over samples."""
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    onehot = np.eye(p.shape[1])[y]
    return float(((p - onehot) ** 2).sum(-1).mean())


def _calibration_gap(confidence: np.ndarray, correct: np.ndarray, bins: list[np.ndarray]) -> float:
    n = len(confidence)
    return float(sum(abs(correct[b].mean() - confidence[b].mean()) * len(b) / n for b in bins if len(b)))


def ece(probs: Any, labels: Any, n_bins: int = 15) -> float:
    """Expected calibration error: equal-width bins [k/n, (k+1)/n) on top-label confidence, L1;
    a confidence of exactly 1.0 goes into the last bin.

    torchmetrics' ``multiclass_calibration_error`` agrees except for confidences of exactly 1.0,
    which it bins apart: ``ece([[1, 0], [.95, .05]], [1, 0])`` is 0.475 here, 0.525 there
    (torchmetrics 1.9; a test pins both).
    """
    n_bins = check_count(n_bins, "n_bins")
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    confidence, correct = p.max(-1), (p.argmax(-1) == y).astype(np.float64)
    index = np.minimum(np.floor(confidence * n_bins).astype(np.int64), n_bins - 1)
    return _calibration_gap(confidence, correct, [np.flatnonzero(index == k) for k in range(n_bins)])


def adaptive_ece(probs: Any, labels: Any, n_bins: int = 15) -> float:
    """ECE with equal-mass bins: samples sorted by confidence, split into ``n_bins`` equal parts."""
    n_bins = check_count(n_bins, "n_bins")
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    confidence, correct = p.max(-1), (p.argmax(-1) == y).astype(np.float64)
    order = np.argsort(confidence, kind="stable")
    return _calibration_gap(confidence, correct, np.array_split(order, min(n_bins, len(order))))


def aurc(probs: Any, labels: Any) -> float:
    """Area under the risk-coverage curve of selective prediction (Geifman et al., 2019): inputs
    answered in order of decreasing top-label confidence, the error rate among the first k
    averaged over k = 1..N (lower is better; ties in confidence keep their order)."""
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    order = np.argsort(-p.max(-1), kind="stable")
    errors = (p.argmax(-1) != y).astype(np.float64)[order]
    return float(np.mean(np.cumsum(errors) / np.arange(1, len(errors) + 1)))


def classification(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, float]:
    """acc, nll, brier, ece, aece and aurc (selective risk) of predicted probabilities (N, C)
    against integer labels (N,)."""
    return {
        "acc": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "brier": brier(probs, labels),
        "ece": ece(probs, labels, n_bins),
        "aece": adaptive_ece(probs, labels, n_bins),
        "aurc": aurc(probs, labels),
    }


def bootstrap_ci(
    probs: Any, labels: Any, n_resamples: int = 1000, level: float = 0.95, seed: int = 0, n_bins: int = 15
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap confidence intervals of every `classification` metric.

    Samples are resampled with replacement ``n_resamples`` times (seeded, `resample_indices`);
    returns, per metric, the (lower, upper) bounds of the central ``level`` interval.
    """
    n_resamples = check_count(n_resamples, "n_resamples")
    percentile_interval(np.zeros(1), level)  # validates the level before any work
    n_bins = check_count(n_bins, "n_bins")
    p = check_probs(probs)
    y = check_labels(labels, *p.shape)
    draws: dict[str, list[float]] = {}
    for index in resample_indices(len(y), n_resamples, seed):
        for key, value in classification(p[index], y[index], n_bins).items():
            draws.setdefault(key, []).append(value)
    return {k: percentile_interval(np.array(v), level) for k, v in draws.items()}
