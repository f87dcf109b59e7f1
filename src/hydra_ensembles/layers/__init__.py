"""Layers for ensembles in one model: grouped (per-member) layers, fused multi-head attention,
BatchEnsemble linear layers."""

from .attention import FusedMultiHeadAttention
from .batch_ensemble import BatchEnsembleLinear
from .grouped import GroupedLayerNorm, GroupedLinear, PerMemberModule

__all__ = [
    "BatchEnsembleLinear",
    "FusedMultiHeadAttention",
    "GroupedLayerNorm",
    "GroupedLinear",
    "PerMemberModule",
]
