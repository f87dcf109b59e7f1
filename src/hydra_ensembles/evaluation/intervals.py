"""Bootstrap intervals of a method's main metrics, paired across methods (the resampling itself:
`metrics.bootstrap`).

The main metrics are the report's table columns: ID accuracy, NLL, Brier, ECE, aECE, and the
OOD average (mean of the near-OOD and far-OOD means, as `evaluate.summarise_ood`) of AUROC,
FPR95, AUPR-In and AUPR-Out for the row's OOD score; every other score's OOD metrics are drawn
too, as ``<metric>@<score>``. Each resample redraws the ID test items and,
independently, each OOD set's items, with indices that depend only on the set's name and size
(`metrics.resample_indices`): every method sees the same resamples, so differences between two
methods come with their own interval and p-value (`add_comparisons`).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

from .. import metrics as M
from ..ood.detectors import FeatureStatistics
from .evaluate import main_row, ood_scores
from .predict import Predictions

MAIN_METRICS = ("acc", "nll", "brier", "ece", "aece", "aurc", "auroc", "fpr95", "aupr_in", "aupr_out")
OOD_METRICS = ("auroc", "fpr95", "aupr_in", "aupr_out")


def bootstrap_draws(
    test: Predictions,
    ood: Mapping[str, tuple[str, Predictions]] | None = None,
    temperature: float | np.ndarray = 1.0,
    n_resamples: int = 200,
    seed: int = 0,
    score: str = "msp",
    others: Sequence[str] = (),
    statistics: FeatureStatistics | None = None,
) -> dict[str, np.ndarray]:
    """(n_resamples,) draws of each main metric for ``score``, and of the OOD metrics of each
    score in ``others`` as ``<metric>@<score>`` (see the module docstring; ``statistics``: the
    feature scores' statistics)."""
    probs, labels = test.probs(temperature), test.class_labels("ID test predictions")
    draws: dict[str, Any] = {k: [] for k in MAIN_METRICS}
    id_index = M.resample_indices(len(labels), n_resamples, seed, "id-test")
    for index in id_index:
        for key, value in M.classification(probs[index], labels[index]).items():
            draws[key].append(value)
    if ood:
        for name in dict.fromkeys([score, *others]):
            for key, values in _ood_draws(test, ood, temperature, name, id_index, statistics, seed).items():
                draws[key if name == score else f"{key}@{name}"] = values
            if name == score and name in others:
                draws.update({f"{k}@{name}": draws[k] for k in OOD_METRICS})
    return {k: np.asarray(v) for k, v in draws.items() if len(v)}


def _ood_draws(test, ood, temperature, score, id_index, statistics, seed) -> dict[str, np.ndarray]:
    """Draws of the OOD average's metrics for ``score``, resampling each set independently."""
    id_scores = ood_scores(test, score, temperature, statistics)
    per_kind: dict[str, list[dict[str, np.ndarray]]] = {"near": [], "far": []}
    for name, (kind, preds) in ood.items():
        scores = ood_scores(preds, score, temperature, statistics)
        ood_index = M.resample_indices(len(scores), len(id_index), seed, f"ood:{name}")
        per_kind[kind].append(M.resampled_ood(id_scores, scores, id_index, ood_index))
    groups = [
        {k: np.mean([s[k] for s in sets], axis=0) for k in sets[0]} for sets in per_kind.values() if sets
    ]
    return {key: np.mean([g[key] for g in groups], axis=0) for key in OOD_METRICS}


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
    score: str | None = None,
) -> None:
    """For each (a, b) with draws for both, row a gets ``differences[b]``: metric -> a - b,
    its paired interval and p-value (`metrics.paired_difference`); the plain OOD metrics compare
    each row's own flag score (``score``: one score for both), ``<metric>@<score>`` the same
    score, and ``<metric>-vs-msp`` a's flag score with b's MSP."""
    for a, b in pairs:
        if a not in draws or b not in draws:
            continue
        values_a, values_b = main_row(results[a], score), main_row(results[b], score)
        differences = {
            key: M.paired_difference(draws[a][key], draws[b][key], values_a[key], values_b[key], level)
            for key in draws[a]
            if key in draws[b] and key in values_a and key in values_b
        }
        for key in OOD_METRICS:  # a's own flag score against b's MSP, the logit flag it replaces
            if key in draws[a] and f"{key}@msp" in draws[b] and f"{key}@msp" in values_b:
                differences[f"{key}-vs-msp"] = M.paired_difference(
                    draws[a][key], draws[b][f"{key}@msp"], values_a[key], values_b[f"{key}@msp"], level
                )
        results[a].setdefault("differences", {})[b] = differences


def add_score_comparisons(
    results: MutableMapping[str, dict[str, Any]],
    draws: Mapping[str, Mapping[str, np.ndarray]],
    level: float = 0.95,
) -> None:
    """Each row with draws gets ``score_differences``: other score -> OOD metric -> (the row's own
    flag score) - (that score) on the same resamples, with its interval and p-value."""
    for name, row_draws in draws.items():
        values = main_row(results[name])
        out = {}
        for key in row_draws:
            metric, _, other = key.partition("@")
            if other and other != results[name].get("flag_score") and metric in row_draws:
                out.setdefault(other, {})[metric] = M.paired_difference(
                    row_draws[metric], row_draws[key], values[metric], values[key], level
                )
        if out:
            results[name]["score_differences"] = out
