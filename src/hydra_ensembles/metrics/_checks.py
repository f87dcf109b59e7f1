"""Input checks shared by the metrics: arrays in, clear errors out."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError


def as_array(values: Any, name: str, ndim: int, dtype=np.float64) -> np.ndarray:
    """A numpy array from a numpy array, torch tensor or sequence, with the expected rank."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    array = np.asarray(values, dtype=dtype)
    if array.ndim != ndim:
        raise InputError(f"{name} must have {ndim} dimension(s), got shape {array.shape}")
    if array.size == 0:
        raise InputError(f"{name} is empty")
    if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
        raise InputError(f"{name} contains NaN or infinite values")
    return array


def check_probs(probs: Any, name: str = "probs") -> np.ndarray:
    array = as_array(probs, name, ndim=2)
    if (array < 0).any() or np.abs(array.sum(-1) - 1).max() > 1e-3:
        raise InputError(f"{name} must be probabilities: non-negative rows summing to 1")
    return array


def check_labels(labels: Any, num_samples: int, num_classes: int) -> np.ndarray:
    array = as_array(labels, "labels", ndim=1, dtype=np.float64)
    if array.shape[0] != num_samples:
        raise InputError(f"labels has {array.shape[0]} entries, probs {num_samples} rows")
    if (array != np.round(array)).any():
        raise InputError("labels must be integers")
    array = array.astype(np.int64)
    if array.min() < 0 or array.max() >= num_classes:
        raise InputError(f"labels must lie in [0, {num_classes - 1}], got {array.min()}..{array.max()}")
    return array


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` if it is an integer of at least ``minimum`` (bins, resamples), else a ValueError:
    a count of 0 must not quietly give an empty metric such as ECE 0.0."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_fraction(value: Any, name: str, low_open: bool = True) -> float:
    """``value`` if it is a finite number in (0, 1] (or [0, 1] with ``low_open=False``)."""
    number = float(value)
    if not np.isfinite(number) or number > 1 or number < 0 or (low_open and number == 0):
        interval = "(0, 1]" if low_open else "[0, 1]"
        raise InputError(f"{name} must lie in {interval}, got {value!r}")
    return number
