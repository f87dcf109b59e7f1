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
from typing import Any

import numpy as np

FLAG_METHODS = ("conformal", "quantile")
"""How a flag threshold is set from ID calibration scores: with the (n + 1) correction
(conformal, the default), or as their plain ``keep`` quantile."""

__all__ = ["FLAG_METHODS", "conformal_p_values", "conformal_threshold", "smallest_alpha"]


def smallest_alpha(n: int) -> float:
    """The smallest level n calibration scores can flag at: 1 / (n + 1)."""
    return 1.0 / (n + 1)


def conformal_threshold(scores: Any, alpha: float) -> float:
    """The k-th smallest of ``scores`` with k = ceil((n + 1)(1 - alpha)): inputs scored above it
    have conformal p-values <= ``alpha``. ValueError where ``alpha`` is below 1 / (n + 1) (too
    few scores to flag anything at that level) or outside (0, 1)."""
    values = np.sort(np.asarray(scores, dtype=np.float64).reshape(-1))
    n = len(values)
    if not 0 < alpha < 1:
        raise ValueError(f"the flag's level alpha must be in (0, 1), got {alpha}")
    if n == 0 or not np.isfinite(values).all():
        raise ValueError("a conformal threshold needs finite calibration scores")
    k = math.ceil((n + 1) * (1 - alpha) - 1e-12)  # guard against 0.95 * 20 = 18.999...
    if k > n:
        raise ValueError(
            f"{n} calibration inputs cannot flag at level {alpha:g} (the smallest level is "
            f"1/(n+1) = {smallest_alpha(n):.3g}): give more ID validation data or a larger level"
        )
    return float(values[k - 1])


def conformal_p_values(calibration_scores: Any, scores: Any) -> np.ndarray:
    """The conformal p-value of each of ``scores`` against the ID ``calibration_scores``."""
    reference = np.sort(np.asarray(calibration_scores, dtype=np.float64).reshape(-1))
    values = np.asarray(scores, dtype=np.float64)
    at_least = len(reference) - np.searchsorted(reference, values, side="left")  # #{s_i >= s}
    return (1.0 + at_least) / (len(reference) + 1.0)
