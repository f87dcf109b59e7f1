"""Bootstrap intervals of a method's main metrics, paired across methods.

The main metrics are the report's table columns: ID accuracy, NLL, Brier, ECE, aECE, and the
OOD average (mean of the near-OOD and far-OOD means, as `evaluate.summarise_ood`) of AUROC,
FPR95, AUPR-In and AUPR-Out for one OOD score. Each resample redraws the ID test items and,
independently, each OOD set's items, with indices that depend only on the set's name and size
(`metrics.resample_indices`): every method sees the same resamples, so differences between two
methods come with their own interval and p-value (`add_comparisons`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from .. import metrics as M
from .evaluate import main_row, ood_scores
from .predict import Predictions

MAIN_METRICS = ("acc", "nll", "brier", "ece", "aece", "auroc", "fpr95", "aupr_in", "aupr_out")


def bootstrap_draws(
    test: Predictions,
    ood: Mapping[str, tuple[str, Predictions]] | None = None,
    temperature: float | np.ndarray = 1.0,
    n_resamples: int = 200,
    seed: int = 0,
    score: str = "msp",
) -> dict[str, np.ndarray]:
    """(n_resamples,) draws of each main metric (see the module docstring)."""
    probs, labels = test.probs(temperature), test.class_labels("ID test predictions")
    draws: dict[str, list[float]] = {k: [] for k in MAIN_METRICS}
    id_index = M.resample_indices(len(labels), n_resamples, seed, "id-test")
    for index in id_index:
        for key, value in M.classification(probs[index], labels[index]).items():
            draws[key].append(value)
    if ood:
        id_scores = ood_scores(test, score, temperature)
        per_kind: dict[str, list[dict[str, np.ndarray]]] = {"near": [], "far": []}
        for name, (kind, preds) in ood.items():
            scores = ood_scores(preds, score, temperature)
            ood_index = M.resample_indices(len(scores), n_resamples, seed, f"ood:{name}")
            rows = [M.ood(id_scores[i], scores[j]) for i, j in zip(id_index, ood_index, strict=True)]
            per_kind[kind].append({k: np.array([r[k] for r in rows]) for k in rows[0]})
        groups = [
            {k: np.mean([s[k] for s in sets], axis=0) for k in sets[0]} for sets in per_kind.values() if sets
        ]
        for key in ("auroc", "fpr95", "aupr_in", "aupr_out"):
            draws[key] = list(np.mean([g[key] for g in groups], axis=0))
    return {k: np.asarray(v) for k, v in draws.items() if len(v)}


def add_intervals(
    results: MutableMapping[str, dict[str, Any]],
    draws: Mapping[str, Mapping[str, np.ndarray]],
    level: float = 0.95,
) -> None:
    """Each result row with draws gets ``intervals``: metric -> [low, high]."""
    for name, row_draws in draws.items():
        results[name]["intervals"] = M.intervals(row_draws, level)
        results[name]["intervals_meta"] = {"level": level, "resamples": len(next(iter(row_draws.values())))}


def add_comparisons(
    results: MutableMapping[str, dict[str, Any]],
    draws: Mapping[str, Mapping[str, np.ndarray]],
    pairs: Sequence[tuple[str, str]],
    level: float = 0.95,
    score: str = "msp",
) -> None:
    """For each (a, b) with draws for both, row a gets ``differences[b]``: metric -> a - b,
    its paired interval and p-value (`metrics.paired_difference`)."""
    for a, b in pairs:
        if a not in draws or b not in draws:
            continue
        values_a, values_b = main_row(results[a], score), main_row(results[b], score)
        results[a].setdefault("differences", {})[b] = {
            key: M.paired_difference(draws[a][key], draws[b][key], values_a[key], values_b[key], level)
            for key in draws[a]
            if key in draws[b] and key in values_a and key in values_b
        }
