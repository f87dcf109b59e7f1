"""Layers for fused ensembles: grouped (per-member) layers and fused multi-head attention."""

from .attention import FusedMultiHeadAttention
from .grouped import GroupedLayerNorm, GroupedLinear, PerMemberModule

__all__ = ["FusedMultiHeadAttention", "GroupedLayerNorm", "GroupedLinear", "PerMemberModule"]
