"""Layers for ensembles in one model: grouped (per-member) layers, fused multi-head attention,
BatchEnsemble linear layers, packed (channel-grouped) layers."""

from .attention import FusedMultiHeadAttention
from .batch_ensemble import BatchEnsembleLinear
from .disentangled import FusedDisentangledAttention, MemberTable
from .grouped import GroupedLayerNorm, GroupedLinear, MemberHeadBias, PerMemberModule
from .indexed_kv import IndexedKVAttention
from .packed import PackedLayerNorm, PackedLinear
from .swapped import FusedQKVAttention, SwappedAttention

__all__ = [
    "BatchEnsembleLinear",
    "FusedDisentangledAttention",
    "FusedMultiHeadAttention",
    "FusedQKVAttention",
    "GroupedLayerNorm",
    "GroupedLinear",
    "IndexedKVAttention",
    "MemberHeadBias",
    "MemberTable",
    "PackedLayerNorm",
    "PackedLinear",
    "PerMemberModule",
    "SwappedAttention",
]
