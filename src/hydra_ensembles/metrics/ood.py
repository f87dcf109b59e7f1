"""OOD detection metrics and scores, following OpenOOD's convention.

OOD is the positive class and scores are "higher = more OOD". AUROC, FPR95 (share of ID
samples flagged at the threshold where 95% of OOD is caught), AUPR-In (ID positive) and
AUPR-Out (OOD positive). All four come from one sort of the scores and the counts of each class
at every distinct threshold (`ranked_counts`), the way scikit-learn's ``roc_curve`` and
``average_precision_score`` compute them (ties share a threshold); the tests hold them equal to
scikit-learn's. A bootstrap resample only counts its draws of each item at the same thresholds
(`resampled_ood`), which is what makes intervals of every OOD metric affordable (timings:
docs/design-notes.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError
from ._checks import as_array, check_fraction, check_probs
from .bootstrap import check_draws, resample_blocks

POSITIVE_CLASS = "OOD"


def _threshold_groups(id_scores: Any, ood_scores: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """Each ID and each OOD score's distinct threshold, numbered from the highest score down (tied
    scores share one, as in scikit-learn's ``_binary_clf_curve``), and how many there are."""
    ids = as_array(id_scores, "id_scores", ndim=1)
    oods = as_array(ood_scores, "ood_scores", ndim=1)
    scores = np.concatenate([ids, oods])
    order = np.argsort(-scores, kind="mergesort")
    numbered = np.cumsum(np.r_[False, np.diff(scores[order]) != 0])  # each sorted score's threshold
    group = np.empty(len(scores), dtype=np.int64)
    group[order] = numbered
    return group[: len(ids)], group[len(ids) :], int(numbered[-1]) + 1


def ranked_counts(group: np.ndarray, draws: np.ndarray, thresholds: int) -> np.ndarray:
    """How many of each row's drawn items (``draws``: indices into ``group``, one row per
    resample) are scored at or above every distinct threshold, highest first (`_threshold_groups`):
    scikit-learn's ``_binary_clf_curve`` counts for one class; a threshold a row draws nothing at
    repeats the previous count. Integers, exact."""
    rows = len(draws)
    offsets = (thresholds * np.arange(rows))[:, None]
    counts = np.bincount((group[draws] + offsets).ravel(), minlength=rows * thresholds)
    return np.cumsum(counts.reshape(rows, thresholds), axis=1)


def _average_precision(fps: np.ndarray, tps: np.ndarray) -> np.ndarray:
    """Sum over thresholds of (recall step) x precision (scikit-learn's definition), per row; a
    repeated threshold adds no recall step."""
    recall = tps / tps[:, -1:]
    steps = np.diff(recall, axis=1, prepend=0.0) * tps
    return np.sum(np.divide(steps, tps + fps, out=np.zeros_like(steps), where=steps > 0), axis=1)


def _ood_metrics(fps: np.ndarray, tps: np.ndarray, tpr: float) -> dict[str, np.ndarray]:
    """The four metrics of each row of `ranked_counts`' ID (``fps``) and OOD (``tps``) counts."""
    ids, oods = fps[:, -1:], tps[:, -1:]
    zero = np.zeros((len(fps), 1), dtype=fps.dtype)
    before_fps, before_tps = np.c_[zero, fps[:, :-1]], np.c_[zero, tps[:, :-1]]  # at the threshold above
    # the ROC's trapezoids in integers: twice the Mann-Whitney count (a tie counts 1/2)
    twice_area = np.sum((fps - before_fps) * (tps + before_tps), axis=1)
    caught = np.argmax(tps / oods >= tpr, axis=1)  # the first threshold catching tpr (tpr > 0)
    # ID positive: the thresholds from the lowest score up, counted from the totals
    inverse_tps, inverse_fps = (ids - before_fps)[:, ::-1], (oods - before_tps)[:, ::-1]
    return {
        "auroc": twice_area / (2 * ids[:, 0] * oods[:, 0]),
        "fpr95": fps[np.arange(len(fps)), caught] / ids[:, 0],
        "aupr_in": _average_precision(inverse_fps, inverse_tps),
        "aupr_out": _average_precision(fps, tps),
    }


def auroc(id_scores: Any, ood_scores: Any) -> float:
    return ood(id_scores, ood_scores)["auroc"]


def resampled_ood(
    id_scores: Any, ood_scores: Any, id_draws: Any, ood_draws: Any, tpr: float = 0.95
) -> dict[str, np.ndarray]:
    """auroc, fpr95, aupr_in and aupr_out of every paired resample: entry r of each is `ood` of
    ``id_scores[id_draws[r]]`` and ``ood_scores[ood_draws[r]]`` (rows of `resample_indices`), from
    one sort of the scores and each resample's counts of every item, in blocks of resamples of
    bounded memory, instead of a sort per resample."""
    id_group, ood_group, thresholds = _threshold_groups(id_scores, ood_scores)
    id_draws, ood_draws = (
        check_draws(id_draws, len(id_group), "id_draws"),
        check_draws(ood_draws, len(ood_group), "ood_draws"),
    )
    if len(id_draws) != len(ood_draws):
        raise InputError(f"id_draws has {len(id_draws)} resamples, ood_draws {len(ood_draws)}")
    tpr = check_fraction(tpr, "tpr")
    width = _WORK_ARRAYS * thresholds + id_draws.shape[1] + ood_draws.shape[1]
    blocks = [
        _ood_metrics(
            ranked_counts(id_group, id_draws[block], thresholds),
            ranked_counts(ood_group, ood_draws[block], thresholds),
            tpr,
        )
        for block in resample_blocks(id_draws, width)
    ]
    return {key: np.concatenate([b[key] for b in blocks]) for key in blocks[0]}


_WORK_ARRAYS = 8
"""About how many arrays of a block's resamples by thresholds `resampled_ood` holds at once."""


def fpr_at_tpr(id_scores: Any, ood_scores: Any, tpr: float = 0.95) -> float:
    """Share of ID samples scored as OOD at the first threshold catching ``tpr`` of the OOD
    (``tpr`` in (0, 1]; no interpolation between thresholds)."""
    return _as_given(id_scores, ood_scores, check_fraction(tpr, "tpr"))["fpr95"]


def ood(id_scores: Any, ood_scores: Any) -> dict[str, float]:
    """auroc, fpr95, aupr_in, aupr_out for OOD-positive scores (higher = more OOD)."""
    return _as_given(id_scores, ood_scores, 0.95)


def _as_given(id_scores: Any, ood_scores: Any, tpr: float) -> dict[str, float]:
    """The metrics of the scores as given: the one resample that draws every item once."""
    ids = as_array(id_scores, "id_scores", ndim=1)
    oods = as_array(ood_scores, "ood_scores", ndim=1)
    once = resampled_ood(ids, oods, np.arange(len(ids))[None], np.arange(len(oods))[None], tpr)
    return {key: float(values[0]) for key, values in once.items()}


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
