"""Diverse members from one ranking of heads (paper B.5: the pruning seed drives diversity).

A ranking orders heads from least to most useful: a circuit order (removal order, first removed
= least useful) or Taylor scores (lowest = least useful). Each member prunes a random subset,
drawn with its own seed, of a pool of the least useful heads: ``heads_per_layer`` keeps k heads
per layer (each layer prunes H - k of its ``pool_size`` least useful heads), ``num_pruned`` prunes
that many heads from the ``pool_size`` least useful heads of the whole model (the paper: 48 of 100).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import InputError
from ..heads import HeadSet, HeadSetError
from ..scoring.circuit import CircuitOrder
from ..scoring.ranking import least_useful_first


def sample_members(
    ranking: CircuitOrder | torch.Tensor | np.ndarray,
    num_members: int = 3,
    heads_per_layer: int | None = None,
    num_pruned: int | None = None,
    pool_size: int | None = None,
    seed: int = 0,
    shared_layers: int = 0,
) -> list[HeadSet]:
    """``num_members`` head sets, each pruning a seeded random subset of the least useful heads.

    Give exactly one of ``heads_per_layer`` (heads each layer keeps) or ``num_pruned`` (heads
    pruned in total). ``pool_size`` defaults to twice the heads pruned (per layer or in total),
    capped by the heads the ranking ranks; a pool (or a pruning) reaching beyond them raises
    `HeadSetError` (unranked heads are never pruned as if they were least useful).
    ``pool_size`` equal to the number pruned gives identical members.
    ``shared_layers=k`` gives every member member 0's heads in the first k layers, so that `fuse`
    can run those layers once as a shared trunk (diversity only in the later layers).
    """
    if num_members < 1:
        raise InputError(f"num_members must be >= 1, got {num_members}")
    if (heads_per_layer is None) == (num_pruned is None):
        raise InputError("give exactly one of heads_per_layer or num_pruned")
    order, heads = least_useful_first(ranking)
    # a circuit ranks only the heads it removed; the rest of ``order`` is index order
    ranked = order[: len(ranking.removed)] if isinstance(ranking, CircuitOrder) else order
    members = []
    for m in range(num_members):
        rng = random.Random(f"hydra-members:{seed}:{m}")
        if heads_per_layer is not None:
            removed = _removed_per_layer(rng, ranked, heads, heads_per_layer, pool_size)
        else:
            removed = _removed_in_total(rng, ranked, heads, num_pruned, pool_size)
        members.append(HeadSet.without(removed, heads))
    if shared_layers:
        members = _share_trunk(members, heads, shared_layers)
    if num_members > 1 and all(hs == members[0] for hs in members[1:]):
        warnings.warn(
            f"the {num_members} members keep the same heads: they are one model, not an ensemble "
            "(make the pool larger than the heads pruned)",
            stacklevel=2,
        )
    elif (distinct := len(set(members))) < num_members:  # HeadSet is a hashable value
        warnings.warn(
            f"only {distinct} of the {num_members} members keep distinct heads: the copies add cost and no "
            "diversity (make the pool larger, or ask for fewer members)",
            stacklevel=2,
        )
    return members


Head = tuple[int, int]


def _removed_per_layer(
    rng: random.Random, ranked: list[Head], heads: list[int], keep: int, pool_size: int | None
) -> list[Head]:
    """One member's removals: ``count - keep`` heads of each layer, drawn from its pool."""
    if not 1 <= keep <= min(heads):
        raise HeadSetError(
            f"heads_per_layer must be in [1, {min(heads)}] (a member keeps at least one head per "
            f"layer), got {keep}"
        )
    removed = []
    for layer, count in enumerate(heads):
        drop = count - keep
        layer_ranked = [h for lay, h in ranked if lay == layer]
        pool = layer_ranked[: _pool(pool_size, drop, len(layer_ranked), count, f"layer {layer}")]
        removed += [(layer, h) for h in rng.sample(pool, drop)]
    return removed


def _removed_in_total(
    rng: random.Random, ranked: list[Head], heads: list[int], num_pruned: int, pool_size: int | None
) -> list[Head]:
    """One member's removals: ``num_pruned`` heads drawn from the model-wide pool."""
    total = sum(heads)
    if not 0 <= num_pruned < total:
        raise HeadSetError(
            f"num_pruned must be in [0, {total - 1}] (a member keeps at least one of the {total} "
            f"heads), got {num_pruned}"
        )
    pool = ranked[: _pool(pool_size, num_pruned, len(ranked), total, "the model")]
    return rng.sample(pool, num_pruned)


def check_shared_layers(shared_layers: int, num_layers: int) -> None:
    """InputError unless a trunk of ``shared_layers`` layers leaves at least one of the model's
    ``num_layers`` layers where the members differ."""
    if not 0 <= shared_layers < num_layers:
        raise InputError(
            f"shared_layers must be in [0, {num_layers - 1}] (the members differ in at least the last of "
            f"the model's {num_layers} layers), got {shared_layers}"
        )


def _share_trunk(members: list[HeadSet], heads: list[int], shared_layers: int) -> list[HeadSet]:
    """Every member with member 0's heads in the first ``shared_layers`` layers
    (`check_shared_layers`)."""
    check_shared_layers(shared_layers, len(heads))
    first = members[0].resolve(heads)
    return [
        HeadSet(
            {
                layer: first[layer] if layer < shared_layers else kept
                for layer, kept in enumerate(hs.resolve(heads))
            }
        )
        for hs in members
    ]


def _pool(pool_size: int | None, drop: int, ranked: int, available: int, where: str) -> int:
    size = min(ranked, 2 * drop) if pool_size is None else pool_size
    if drop > ranked or size > ranked:
        raise HeadSetError(
            f"the ranking ranks {ranked} of the {available} heads of {where}, but "
            f"{'the pool' if size > ranked else 'each member'} needs {max(size, drop)}: rank more heads "
            "(a larger circuit --budget) or prune fewer (--pool-size is per layer with --heads-per-layer)"
        )
    if size < drop:
        raise HeadSetError(f"pool_size ({size}) must be at least the heads pruned ({drop}) in {where}")
    return size


def member_overlap(head_sets: Sequence[HeadSet], original_heads_per_layer: Sequence[int]) -> np.ndarray:
    """(M, M) Jaccard similarity of the members' kept (layer, head) sets."""
    m = len(head_sets)
    out = np.ones((m, m))
    for i in range(m):
        for j in range(i + 1, m):
            out[i, j] = out[j, i] = head_sets[i].jaccard(head_sets[j], original_heads_per_layer)
    return out
