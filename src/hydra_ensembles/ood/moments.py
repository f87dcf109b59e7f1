"""The Mahalanobis scores' statistics from sums that add up over any split of the training rows,
so that a fit over data split across processes (`hydra_ensembles.distributed.statistics`) equals
`FeatureStatistics.fit` on the same rows, to float64 rounding.

Two passes, the numerically stable way: the first sums each class's rows (their means follow),
the second sums the outer products and fourth powers of the rows around those final means (the
scatter and what Ledoit-Wolf's shrinkage reads: `geometry.shrunk_covariance`). One pass over raw
moments would subtract large numbers from large numbers. The scores fit this way are
`MERGEABLE_SCORES`: ``mds`` (class means, one covariance around them), ``rmds`` (the mean of all
rows, their covariance) and ``mds++`` (``mds`` on unit-length rows); the others keep a bank of
rows, a principal space fit after the means, or every layer's token, and are fit in one process.

Each function takes one block of rows: features (M, N, D) and class ids (N,), float64."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ..errors import InputError
from .detectors import BANK_SIZE, FORMAT, KNN_K, FeatureStatistics
from .geometry import inverse_covariance, normalised, shrunk_covariance

MERGEABLE_SCORES = ("mds", "rmds", "mds++")
"""The feature scores whose fit follows from sums over blocks of rows."""

__all__ = ["MERGEABLE_SCORES", "add", "first_sums", "second_sums", "statistics_from_sums"]


def first_sums(features: np.ndarray, labels: np.ndarray, classes: int) -> dict[str, np.ndarray]:
    """A block's first pass: rows per class (C,), each class's sum of rows (M, C, D) and of
    unit-length rows (``mds++``)."""
    x, y = np.asarray(features, np.float64), np.asarray(labels, np.int64)
    onehot = np.eye(classes)[y]  # (N, C): the class sums as one product
    return {
        "counts": onehot.sum(0),
        "sums": np.einsum("nc,mnd->mcd", onehot, x),
        "unit_sums": np.einsum("nc,mnd->mcd", onehot, normalised(x)),
    }


def add(blocks: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sums of several blocks, in any order."""
    total: dict[str, np.ndarray] = {}
    for block in blocks:
        for key, value in block.items():
            total[key] = total[key] + value if key in total else np.asarray(value, np.float64).copy()
    if not total:
        raise InputError("no training rows: the statistics need labelled ID training data")
    return total


def _means(first: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The class means (M, C, D; zero for a class without rows), the unit-length rows' class
    means, and the mean of all rows (M, D)."""
    counts = first["counts"]
    safe = np.maximum(counts, 1)[None, :, None]
    return {
        "mds": first["sums"] / safe,
        "mds++": first["unit_sums"] / safe,
        "rmds": first["sums"].sum(1) / counts.sum(),
    }


def second_sums(
    features: np.ndarray, labels: np.ndarray, first: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A block's second pass, around the means of every block's first pass (``first``: `add`
    of `first_sums`): per score, the scatter (M, D, D) and the sum of fourth powers (M,) of the
    rows around their mean."""
    x, y = np.asarray(features, np.float64), np.asarray(labels, np.int64)
    means = _means(first)
    centred = {
        "mds": x - means["mds"][:, y],
        "mds++": normalised(x) - means["mds++"][:, y],
        "rmds": x - means["rmds"][:, None],
    }
    sums = {}
    for name, c in centred.items():
        c2 = c**2
        sums[f"{name}.scatter"] = np.einsum("mnd,mne->mde", c, c)
        sums[f"{name}.fourth"] = np.einsum("mnd,mne->m", c2, c2)
    return sums


def statistics_from_sums(
    first: Mapping[str, np.ndarray],
    second: Mapping[str, np.ndarray],
    classes: int,
    *,
    knn_k: int = KNN_K,
    bank_size: int = BANK_SIZE,
) -> FeatureStatistics:
    """The `FeatureStatistics` of `MERGEABLE_SCORES` from the added sums of both passes: what
    ``FeatureStatistics.fit(features, labels, classes, scores=MERGEABLE_SCORES)`` fits on the same
    rows, to float64 rounding."""
    counts = first["counts"]
    n = int(counts.sum().round())
    members, _, width = first["sums"].shape
    if n < 2:
        raise InputError(f"feature statistics need two training rows or more, got {n}")
    present = np.flatnonzero(counts > 0)
    means = _means(first)
    tensors: dict[str, np.ndarray] = {}
    for name in MERGEABLE_SCORES:
        precisions = np.stack(
            [
                inverse_covariance(
                    shrunk_covariance(second[f"{name}.scatter"][m], float(second[f"{name}.fourth"][m]), n),
                    name,
                )
                for m in range(members)
            ]
        )
        if name == "rmds":
            tensors["rmds.mean"] = means["rmds"]
        else:
            tensors[f"{name}.means"] = means[name][:, present]
        tensors[f"{name}.precision"] = precisions
    settings = {
        "format": FORMAT,
        "members": int(members),
        "classes": int(classes),
        "width": int(width),
        "examples": n,
        "knn_k": int(min(knn_k, n, bank_size)),
        "vim_dim": None,
        "scores": list(MERGEABLE_SCORES),
    }
    return FeatureStatistics(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, settings
    )
