"""A head ranking (Taylor scores or a circuit order) as one order of all heads."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InputError
from .circuit import CircuitOrder


def least_useful_first(
    ranking: CircuitOrder | torch.Tensor | np.ndarray,
) -> tuple[list[tuple[int, int]], list[int]]:
    """All heads ordered from least to most useful, and the heads per layer."""
    if isinstance(ranking, CircuitOrder):
        heads = list(ranking.original_heads_per_layer)
        rest = [
            (lay, h) for lay, n in enumerate(heads) for h in range(n) if (lay, h) not in set(ranking.removed)
        ]
        return list(ranking.removed) + rest, heads  # unranked heads after the removed ones, in index order
    scores = torch.as_tensor(np.asarray(ranking, dtype=np.float64))
    if scores.dim() != 2:
        raise InputError(f"scores must be (layers, heads), got shape {tuple(scores.shape)}")
    heads = [int((~torch.isnan(row)).sum()) for row in scores]
    entries = [(scores[lay, h].item(), lay, h) for lay, n in enumerate(heads) for h in range(n)]
    return [(lay, h) for _, lay, h in sorted(entries)], heads
