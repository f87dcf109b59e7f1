"""Ensemble diversity: mutual information and disagreement (paper Table 9)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checks import as_array
from .ood import mutual_information_score


def disagreement(member_probs: Any) -> float:
    """Mean over samples and member pairs of [argmax of member i != argmax of member j]."""
    p = as_array(member_probs, "member_probs", ndim=3)
    m = p.shape[0]
    if m < 2:
        return 0.0
    votes = p.argmax(-1)
    pairs = [(votes[i] != votes[j]).mean() for i in range(m) for j in range(i + 1, m)]
    return float(np.mean(pairs))


def diversity(member_probs: Any) -> dict[str, float]:
    """mutual_information (mean over samples, nats) and disagreement of member probs (M, N, C)."""
    return {
        "mutual_information": float(mutual_information_score(member_probs).mean()),
        "disagreement": disagreement(member_probs),
    }
