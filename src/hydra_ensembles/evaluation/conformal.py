"""Conformal p-values of OOD scores, and the flag threshold with a bounded false-flag rate.

Given the OOD scores s_1..s_n of n labelled ID calibration inputs (higher = more likely OOD), an
input scored s gets the conformal p-value

    p(s) = (1 + #{i : s_i >= s}) / (n + 1)

and is flagged at level alpha when p(s) <= alpha, which is the same as s exceeding the
k-th smallest calibration score with k = ceil((n + 1)(1 - alpha)) (`conformal_threshold`). Where
the calibration inputs and a new ID input are exchangeable (drawn alike, the score fixed without
looking at them), the chance that the new input is flagged is at most alpha: exactly
floor((n + 1) alpha) / (n + 1) for scores without ties. Nothing is promised for OOD inputs. The
plain empirical quantile (``flag_method="quantile"``) lacks the (n + 1) correction and flags ID
inputs up to about 1/n more often than alpha (Vovk et al., 2005; Angelopoulos and Bates, 2021).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from ..errors import InputError
from ..inputs import class_ids

__all__ = [
    "benjamini_hochberg",
    "conformal_p_values",
    "conformal_threshold",
    "flag_count",
    "flags",
    "one_draw_range",
    "smallest_alpha",
]


def smallest_alpha(n: int) -> float:
    """The smallest level n calibration scores can flag at: 1 / (n + 1)."""
    return 1.0 / (n + 1)


def flag_count(n: int, alpha: float) -> int:
    """The largest j with ``j / (n + 1) <= alpha`` as the p-values compare in floating point: an
    input is flagged at level ``alpha`` where ``1 + #{s_i >= s}`` is at most this count, the same
    decision as its reported p-value ``<= alpha``, decided on integers (no rounding guard)."""
    if not 0 < alpha < 1:
        raise InputError(f"the flag's level alpha must be in (0, 1), got {alpha}")
    j = min(n + 1, int(Fraction(alpha) * (n + 1)))  # floor of the exact product; then as floats compare
    while j <= n and (j + 1) / (n + 1) <= alpha:
        j += 1
    while j > 0 and j / (n + 1) > alpha:
        j -= 1
    return j


def conformal_threshold(scores: Any, alpha: float) -> float:
    """The k-th smallest of ``scores`` with k = n + 1 - `flag_count` (about
    ceil((n + 1)(1 - alpha))): inputs scored above it are exactly those whose conformal p-values
    are <= ``alpha``. ValueError where ``alpha`` is below 1 / (n + 1) (too few scores to flag
    anything at that level) or outside (0, 1)."""
    values = np.sort(np.asarray(scores, dtype=np.float64).reshape(-1))
    n = len(values)
    if not 0 < alpha < 1:
        raise InputError(f"the flag's level alpha must be in (0, 1), got {alpha}")
    if n == 0 or not np.isfinite(values).all():
        raise InputError("a conformal threshold needs finite calibration scores")
    k = n + 1 - flag_count(n, alpha)
    if k > n:
        raise InputError(
            f"{n} calibration inputs cannot flag at level {alpha:g} (the smallest level is "
            f"1/(n+1) = {smallest_alpha(n):.3g}): give more ID validation data or a larger level"
        )
    return float(values[k - 1])


def flags(scores: Any, threshold: float) -> np.ndarray:
    """Which of ``scores`` the flag at ``threshold`` raises: those not at or below it, so a score
    that is not a number (NaN, from features that overflowed) is flagged, as its p-value (the
    smallest) says. The one rule of every served flag."""
    return ~(np.asarray(scores, dtype=np.float64) <= threshold)


def quantile_threshold(scores: Any, keep: float) -> float:
    """The plain ``keep`` quantile of ``scores`` (no finite-sample correction): the
    ``flag_method="quantile"`` threshold, below which a share ``keep`` of them fall."""
    return float(np.quantile(np.asarray(scores, dtype=np.float64).reshape(-1), keep))


def conformal_p_values(calibration_scores: Any, scores: Any) -> np.ndarray:
    """The conformal p-value of each of ``scores`` against the ID ``calibration_scores``."""
    reference = np.sort(np.asarray(calibration_scores, dtype=np.float64).reshape(-1))
    values = np.asarray(scores, dtype=np.float64)
    at_least = len(reference) - np.searchsorted(reference, values, side="left")  # #{s_i >= s}
    at_least = np.where(np.isnan(values), 0, at_least)  # not a number: as far out as any score (flagged)
    return (1.0 + at_least) / (len(reference) + 1.0)


def _beta_quantile(a: int, b: int, q: float) -> float:
    """The q-quantile of Beta(a, b) for whole a, b >= 1: bisection on its CDF, which for whole
    parameters is P(Binomial(a + b - 1, x) >= a) (no special functions needed)."""
    trials = a + b - 1

    def cdf(x: float) -> float:
        if x <= 0:
            return 0.0
        if x >= 1:
            return 1.0
        logs = [
            math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
            + k * math.log(x) + (trials - k) * math.log1p(-x)
            for k in range(a, trials + 1)
        ]  # fmt: skip
        top = max(logs)
        return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))

    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < q else (low, middle)
    return (low + high) / 2


def one_draw_range(n: int, alpha: float, probability: float = 0.95) -> tuple[float, float]:
    """How far one draw of ``n`` calibration inputs may leave the level ``alpha``: the share of
    new exchangeable inputs whose conformal p-value is <= alpha is, given the draw, Beta(l,
    n + 1 - l) with l = floor((n + 1) alpha) (Vovk, 2012). Returns its mean and the value it stays
    under for a share ``probability`` of draws: for a flag, the false-alarm rate; for prediction
    sets, one minus their coverage."""
    flagged = flag_count(n, alpha)
    if flagged == 0:
        return 0.0, 0.0
    return flagged / (n + 1), _beta_quantile(flagged, n + 1 - flagged, probability)


def benjamini_hochberg(p_values: Any, level: float) -> np.ndarray:
    """Which of a batch's inputs the Benjamini-Hochberg procedure selects at false discovery
    rate ``level`` from their conformal p-values (booleans): the k smallest, k the largest rank
    with ``p_(k) <= k level / m``. Conformal p-values of one calibration set are positively
    dependent (PRDS), so among the selected inputs the expected share of ID ones is at most
    ``level`` (times the share of ID inputs in the batch), whatever the OOD inputs are (Bates et
    al., "Testing for outliers with conformal p-values", Ann. Statist. 2023). Unlike the
    per-input flag, which flags at most a share alpha of ID inputs, this bounds the share of
    false alarms among the inputs flagged in one batch."""
    p = np.asarray(p_values, dtype=np.float64).reshape(-1)
    values, counts = np.unique(p, return_counts=True)
    return p <= benjamini_hochberg_cutoff(values, counts, level)


def benjamini_hochberg_cutoff(values: Any, counts: Any, level: float) -> float:
    """The p-value at or below which `benjamini_hochberg` selects, from the batch's distinct
    p-values ``values`` and how many inputs hold each (``counts``), in any order; -inf where it
    selects nothing. Conformal p-values lie on the grid k/(n+1) of one calibration set, so a batch
    of any size has at most n+1 distinct values: the selection over a dataset split across
    processes follows exactly from one count per value (`hydra_ensembles.distributed`), no sort
    of the inputs. The largest rank passing ``p_(k) <= k level / m`` falls on the last input of a
    run of ties, so testing each value at its cumulative count decides the same ranks."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if not 0 < level < 1:
        raise InputError(f"the false discovery rate must be in (0, 1), got {level}")
    if not np.isfinite(values).all() or (values < 0).any() or (values > 1).any():
        raise InputError("Benjamini-Hochberg needs p-values in [0, 1]")
    if values.shape != counts.shape or (counts < 1).any():
        raise InputError("Benjamini-Hochberg needs one positive count per distinct p-value")
    order = np.argsort(values, kind="stable")
    values, ranks = values[order], np.cumsum(counts[order])
    passing = np.flatnonzero(values * ranks[-1:].sum() <= level * ranks) if len(values) else []
    return float(values[passing[-1]]) if len(passing) else -np.inf


NONCONFORMITY_SCORES = ("lac", "aps", "raps")
"""The prediction sets' non-conformity scores `set_scores` computes (a calibration's settings
name them: `calibration.settings.SET_METHODS`)."""


def set_scores(
    probs: Any,
    method: str = "lac",
    *,
    randomized: bool = False,
    penalty: float = 0.01,
    k_reg: int = 1,
    uniform: Any = None,
) -> np.ndarray:
    """The non-conformity score of every class for every input, (N, C), from calibrated class
    probabilities (N, C): LAC ``1 - p_y``; APS the probability of the classes ranked above y plus
    p_y (``randomized``: plus ``u * p_y`` instead, u uniform in [0, 1) per input, from
    ``uniform``); RAPS APS plus ``penalty * max(0, rank(y) - k_reg)`` (ranks from 1).
    (Angelopoulos et al., 2021; Romano et al., 2020.)"""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise InputError(f"probabilities must be (inputs, classes), got {p.shape}")
    if method not in NONCONFORMITY_SCORES:
        raise InputError(f"unknown prediction-set method {method!r}; choose from {NONCONFORMITY_SCORES}")
    if method == "lac":
        return 1.0 - p
    order = np.argsort(-p, axis=1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=1)
    above = np.cumsum(sorted_p, axis=1) - sorted_p  # mass ranked strictly above
    own = sorted_p if not randomized else sorted_p * np.asarray(uniform, dtype=np.float64).reshape(-1, 1)
    scores_sorted = above + own
    if method == "raps":
        ranks = np.arange(1, p.shape[1] + 1)[None]
        scores_sorted = scores_sorted + penalty * np.maximum(0, ranks - k_reg)
    scores = np.empty_like(scores_sorted)
    np.put_along_axis(scores, order, scores_sorted, axis=1)
    return scores


def set_quantile(scores: Any, alpha: float) -> float:
    """The split-conformal quantile of calibration scores: their ceil((n + 1)(1 - alpha))-th
    smallest, or infinity where there are too few of them (every class is then in every set)."""
    values = np.asarray(scores, dtype=np.float64).reshape(-1)
    if not 0 < alpha < 1:
        raise InputError(f"the sets' level alpha must be in (0, 1), got {alpha}")
    if len(values) == 0 or alpha < smallest_alpha(len(values)):
        return math.inf
    return conformal_threshold(values, alpha)


def fit_set_quantiles(
    probs: Any, labels: Any, alpha: float, method: str = "lac", classwise: bool = False, **options: Any
) -> np.ndarray:
    """The quantile(s) of the true classes' scores on labelled calibration data: one, or
    (``classwise``, Mondrian) one per class from that class's examples alone, (C,)."""
    p = np.asarray(probs, dtype=np.float64)
    y = class_ids(labels, p.shape[-1], "the prediction sets' calibration data").reshape(-1)
    if len(y) != len(p):
        raise InputError(f"{len(y)} labels for {len(p)} inputs")
    true = set_scores(p, method, **options)[np.arange(len(y)), y]
    if not classwise:
        return np.full(p.shape[1], set_quantile(true, alpha))
    return np.array([set_quantile(true[y == c], alpha) for c in range(p.shape[1])])


def prediction_sets(probs: Any, quantiles: Any, method: str = "lac", **options: Any) -> np.ndarray:
    """Which classes are in each input's set, (N, C) booleans: those whose score is at most the
    quantile (of their class, for Mondrian sets)."""
    scores = set_scores(probs, method, **options)
    return scores <= np.asarray(quantiles, dtype=np.float64)[None]
