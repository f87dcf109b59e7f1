"""Bootstrap resampling: shared indices (so methods compared on the same resamples are paired),
percentile intervals, and paired differences with a p-value.

Pairing is what makes "Hydra vs Deep Ensemble" testable on a few hundred test items: both
methods are scored on the same resampled items, so the item-to-item difficulty that moves both
cancels in their difference.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..errors import InputError
from ._checks import as_array, check_count, check_fraction


def resample_indices(size: int, n_resamples: int, seed: int = 0, salt: str = "") -> np.ndarray:
    """(n_resamples, size) indices drawn with replacement; the same for the same (size, seed,
    salt), whichever method asks, so resamples are paired across methods."""
    n_resamples = check_count(n_resamples, "n_resamples")
    size = check_count(size, "size")
    rng = np.random.default_rng([seed, zlib.crc32(salt.encode()), size])
    return rng.integers(0, size, (n_resamples, size))


def resample_blocks(draws: np.ndarray, width: int) -> Iterator[slice]:
    """Consecutive blocks of the rows of ``draws`` (resamples) whose work arrays, ``width``
    entries a row, hold at most `BLOCK` entries together: computing all resamples at once without
    holding them all."""
    rows = max(1, BLOCK // max(1, width))
    for start in range(0, len(draws), rows):
        yield slice(start, start + rows)


BLOCK = 1 << 22
"""Most entries of the work arrays of one block of resamples (`resample_blocks`): 32 MiB of
float64."""


def check_draws(draws: Any, size: int, name: str) -> np.ndarray:
    """``draws`` as resamples of ``size`` items (`resample_indices`' shape: a row of indices in
    [0, size) per resample); InputError otherwise."""
    array = np.asarray(draws)
    if array.ndim != 2 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must be a non-empty 2-D array of indices, got shape {array.shape}")
    if array.min() < 0 or array.max() >= size:
        raise InputError(f"{name} holds indices outside 0..{size - 1}")
    return array.astype(np.int64, copy=False)


def resampled_mean(values: Any, draws: Any) -> np.ndarray:
    """The mean of ``values`` (1-D) over each resample (each row of ``draws``, as
    `resample_indices` gives)."""
    values = as_array(values, "values", ndim=1)
    draws = check_draws(draws, len(values), "draws")
    return np.concatenate([values[draws[b]].mean(1) for b in resample_blocks(draws, draws.shape[1])])


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` percentile interval of bootstrap draws (NaN draws are ignored)."""
    if check_fraction(level, "level") == 1:
        raise InputError("level must lie in (0, 1), got 1")
    tail = (1 - level) / 2 * 100
    return float(np.nanpercentile(draws, tail)), float(np.nanpercentile(draws, 100 - tail))


def paired_difference(
    draws_a: np.ndarray, draws_b: np.ndarray, value_a: float, value_b: float, level: float = 0.95
) -> dict[str, float]:
    """a - b on the full data, its percentile interval over the paired draws, and the two-sided
    bootstrap p-value of "no difference": twice the share of draws on the far side of 0."""
    differences = np.asarray(draws_a, dtype=np.float64) - np.asarray(draws_b, dtype=np.float64)
    if differences.shape != np.shape(draws_a) or differences.ndim != 1:
        raise InputError("paired draws must be two 1-D arrays of the same resamples")
    low, high = percentile_interval(differences, level)
    finite = differences[np.isfinite(differences)]
    p_value = (
        min(1.0, 2 * min(float(np.mean(finite <= 0)), float(np.mean(finite >= 0)))) if finite.size else 1.0
    )
    return {"difference": float(value_a - value_b), "low": low, "high": high, "p_value": p_value}


def intervals(draws: Mapping[str, np.ndarray], level: float = 0.95) -> dict[str, list[float]]:
    """Percentile interval of each metric's draws."""
    return {key: list(percentile_interval(values, level)) for key, values in draws.items()}
