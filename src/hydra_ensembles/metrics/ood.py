"""OOD detection metrics and scores, following OpenOOD's convention.

OOD is the positive class and scores are "higher = more OOD". AUROC, FPR95 (share of ID
samples flagged at the threshold where 95% of OOD is caught), AUPR-In (ID positive) and
AUPR-Out (OOD positive). All four come from one sorted pass over the scores (`ranked_counts`),
the way scikit-learn's ``roc_curve`` and ``average_precision_score`` compute them (ties share a
threshold); the tests hold them equal to scikit-learn's. One pass instead of the scikit-learn
calls is what makes bootstrap intervals of every OOD metric affordable (timings:
docs/design-notes.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError
from ._checks import as_array, check_fraction, check_probs
from .bootstrap import resample_blocks

POSITIVE_CLASS = "OOD"


def _scores_and_labels(id_scores: Any, ood_scores: Any) -> tuple[np.ndarray, np.ndarray]:
    ids = as_array(id_scores, "id_scores", ndim=1)
    oods = as_array(ood_scores, "ood_scores", ndim=1)
    scores = np.concatenate([ids, oods])
    labels = np.concatenate([np.zeros(len(ids)), np.ones(len(oods))])
    return scores, labels


def ranked_counts(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False and true positives at every distinct threshold, highest first (scikit-learn's
    ``_binary_clf_curve``): entry k counts the items scored >= the k-th distinct score."""
    order = np.argsort(-scores, kind="mergesort")
    ranked, positives = scores[order], labels[order]
    last = np.r_[np.flatnonzero(np.diff(ranked)), len(ranked) - 1]  # last item of each tie group
    tps = np.cumsum(positives)[last]
    return last + 1 - tps, tps


def _average_precision(fps: np.ndarray, tps: np.ndarray) -> float:
    """Sum over thresholds of (recall step) x precision (scikit-learn's definition)."""
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * tps / (tps + fps)))


def _ood_metrics(scores: np.ndarray, labels: np.ndarray, tpr: float = 0.95) -> dict[str, float]:
    fps, tps = ranked_counts(scores, labels)
    fpr, tpr_curve = np.r_[0.0, fps / fps[-1]], np.r_[0.0, tps / tps[-1]]
    inverse_fps, inverse_tps = ranked_counts(-scores, 1 - labels)
    return {
        "auroc": float(np.sum(np.diff(fpr) * (tpr_curve[1:] + tpr_curve[:-1]) / 2)),
        "fpr95": float(fpr[np.argmax(tpr_curve >= tpr)]),
        "aupr_in": _average_precision(inverse_fps, inverse_tps),
        "aupr_out": _average_precision(fps, tps),
    }


def auroc(id_scores: Any, ood_scores: Any) -> float:
    return ood(id_scores, ood_scores)["auroc"]


def resampled_auroc(id_scores: Any, ood_scores: Any, id_draws: Any, ood_draws: Any) -> np.ndarray:
    """The AUROC of every paired resample: entry r is ``auroc(id_scores[id_draws[r]],
    ood_scores[ood_draws[r]])`` (rows of `resample_indices`), computed for all rows at once as the
    Mann-Whitney count the ROC's trapezoid area equals (each ID-OOD pair ordered right counts 1, a
    tie 1/2), in integers, instead of a sort per resample."""
    ids = as_array(id_scores, "id_scores", ndim=1)
    oods = as_array(ood_scores, "ood_scores", ndim=1)
    id_draws, ood_draws = _draws(id_draws, len(ids), "id_draws"), _draws(ood_draws, len(oods), "ood_draws")
    if len(id_draws) != len(ood_draws):
        raise InputError(f"id_draws has {len(id_draws)} resamples, ood_draws {len(ood_draws)}")
    order = np.argsort(ids, kind="mergesort")
    rank = np.empty(len(ids), dtype=np.int64)
    rank[order] = np.arange(len(ids))  # each ID item's place in the sorted ID scores
    # per OOD item: how many sorted ID scores lie below it, and below or at it
    below = np.searchsorted(ids[order], oods, side="left")
    at_or_below = np.searchsorted(ids[order], oods, side="right")
    out = np.empty(len(id_draws))
    for block in resample_blocks(id_draws, max(len(ids) + 1, *id_draws.shape[1:], *ood_draws.shape[1:])):
        draws, picked = id_draws[block], ood_draws[block]
        n = len(draws)
        counts = np.bincount(
            (rank[draws] + (len(ids) * np.arange(n))[:, None]).ravel(), minlength=n * len(ids)
        ).reshape(n, len(ids))  # how often each sorted ID item is drawn
        cumulative = np.zeros((n, len(ids) + 1), dtype=np.int64)
        np.cumsum(counts, axis=1, out=cumulative[:, 1:])
        twice = np.take_along_axis(cumulative, below[picked], 1) + np.take_along_axis(
            cumulative, at_or_below[picked], 1
        )  # twice each drawn OOD item's count of ID items below it, ties counted 1/2
        out[block] = twice.sum(1) / (2 * draws.shape[1] * picked.shape[1])
    return out


def _draws(draws: Any, size: int, name: str) -> np.ndarray:
    array = np.asarray(draws)
    if array.ndim != 2 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must be a non-empty 2-D array of indices, got shape {array.shape}")
    if array.min() < 0 or array.max() >= size:
        raise InputError(f"{name} holds indices outside 0..{size - 1}")
    return array.astype(np.int64, copy=False)


def fpr_at_tpr(id_scores: Any, ood_scores: Any, tpr: float = 0.95) -> float:
    """Share of ID samples scored as OOD at the first threshold catching ``tpr`` of the OOD
    (``tpr`` in (0, 1]; no interpolation between thresholds)."""
    tpr = check_fraction(tpr, "tpr")
    return _ood_metrics(*_scores_and_labels(id_scores, ood_scores), tpr)["fpr95"]


def ood(id_scores: Any, ood_scores: Any) -> dict[str, float]:
    """auroc, fpr95, aupr_in, aupr_out for OOD-positive scores (higher = more OOD)."""
    return _ood_metrics(*_scores_and_labels(id_scores, ood_scores))


# ----------------------------------------------------------------------------- scores
def msp_score(probs: Any) -> np.ndarray:
    """1 - maximum softmax probability (higher = more OOD); ``probs`` is (N, C) probabilities
    (logits are refused: their maximum is no probability)."""
    return 1.0 - check_probs(probs).max(-1)


def max_logit_score(logits: Any) -> np.ndarray:
    """Negative maximum logit; for ensembles pass the member-mean logits."""
    return -as_array(logits, "logits", ndim=2).max(-1)


def energy_score(logits: Any, temperature: float = 1.0) -> np.ndarray:
    """Negative free energy -T logsumexp(logits / T) with the sign flipped: higher = more OOD."""
    x = as_array(logits, "logits", ndim=2) / temperature
    m = x.max(-1, keepdims=True)
    return -(temperature * (m[:, 0] + np.log(np.exp(x - m).sum(-1))))


def entropy_score(probs: Any) -> np.ndarray:
    """Predictive entropy (nats) of probabilities (N, C); logits are refused."""
    p = check_probs(probs)
    return -(p * np.log(np.clip(p, 1e-12, None))).sum(-1)


GEN_GAMMA = 0.1
GEN_TOP = 100


def gen_score(probs: Any, gamma: float = GEN_GAMMA, top: int = GEN_TOP) -> np.ndarray:
    """Generalized entropy (Liu et al., 2023, GEN): ``sum_j p_j^gamma (1 - p_j)^gamma`` over the
    ``top`` largest probabilities (all of them for fewer classes); higher = more OOD. The
    authors' settings, gamma = 0.1 and the top 100, are the defaults."""
    p = check_probs(probs)
    kept = np.sort(p, axis=-1)[:, -min(top, p.shape[-1]) :]
    return (kept**gamma * (1 - kept) ** gamma).sum(-1)


def mutual_information_score(member_probs: Any) -> np.ndarray:
    """Entropy of the mean minus mean entropy, per sample, for member probabilities (M, N, C)."""
    p = as_array(member_probs, "member_probs", ndim=3)
    check_probs(p.reshape(-1, p.shape[-1]), "member_probs")
    mean_entropy = np.mean([entropy_score(m) for m in p], axis=0)
    return entropy_score(p.mean(0)) - mean_entropy
