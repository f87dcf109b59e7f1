"""OOD detection metrics and scores, following OpenOOD's convention.

OOD is the positive class and scores are "higher = more OOD". AUROC, FPR95 (share of ID
samples flagged at the threshold where 95% of OOD is caught), AUPR-In (ID positive) and
AUPR-Out (OOD positive). Ranking metrics come from scikit-learn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from ._checks import as_array, check_fraction, check_probs

POSITIVE_CLASS = "OOD"


def _scores_and_labels(id_scores: Any, ood_scores: Any) -> tuple[np.ndarray, np.ndarray]:
    ids = as_array(id_scores, "id_scores", ndim=1)
    oods = as_array(ood_scores, "ood_scores", ndim=1)
    scores = np.concatenate([ids, oods])
    labels = np.concatenate([np.zeros(len(ids)), np.ones(len(oods))])
    return scores, labels


def auroc(id_scores: Any, ood_scores: Any) -> float:
    scores, labels = _scores_and_labels(id_scores, ood_scores)
    return float(roc_auc_score(labels, scores))


def fpr_at_tpr(id_scores: Any, ood_scores: Any, tpr: float = 0.95) -> float:
    """Share of ID samples scored as OOD at the first threshold catching ``tpr`` of the OOD
    (``tpr`` in (0, 1]; no interpolation between thresholds)."""
    tpr = check_fraction(tpr, "tpr")
    scores, labels = _scores_and_labels(id_scores, ood_scores)
    fprs, tprs, _ = roc_curve(labels, scores, drop_intermediate=False)
    return float(fprs[np.argmax(tprs >= tpr)])


def ood(id_scores: Any, ood_scores: Any) -> dict[str, float]:
    """auroc, fpr95, aupr_in, aupr_out for OOD-positive scores (higher = more OOD)."""
    scores, labels = _scores_and_labels(id_scores, ood_scores)
    return {
        "auroc": float(roc_auc_score(labels, scores)),
        "fpr95": fpr_at_tpr(id_scores, ood_scores, 0.95),
        "aupr_in": float(average_precision_score(1 - labels, -scores)),
        "aupr_out": float(average_precision_score(labels, scores)),
    }


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


def mutual_information_score(member_probs: Any) -> np.ndarray:
    """Entropy of the mean minus mean entropy, per sample, for member probabilities (M, N, C)."""
    p = as_array(member_probs, "member_probs", ndim=3)
    check_probs(p.reshape(-1, p.shape[-1]), "member_probs")
    mean_entropy = np.mean([entropy_score(m) for m in p], axis=0)
    return entropy_score(p.mean(0)) - mean_entropy
