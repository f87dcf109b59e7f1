"""Architecture adapters: one small class per model family.

`get_adapter(model)` picks the adapter for a model; `register_adapter` adds a family.
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import ArchitectureAdapter, AttentionBlock, WholeAttentionAdapter, ZeroHeadAttention
from .bert import BertAdapter
from .clip import ClipTextAdapter, ClipVisionAdapter
from .deberta import DebertaV2Adapter
from .decoder import DecoderAdapter
from .dinov2 import Dinov2Adapter
from .distilbert import DistilBertAdapter
from .dual import DualEncoderAdapter
from .modernbert import ModernBertAdapter
from .mpnet import MPNetAdapter
from .registry import ADAPTERS, get_adapter, pools_last_token, register_adapter, supported_families
from .siglip import Siglip2TextAdapter, Siglip2VisionAdapter, SiglipTextAdapter, SiglipVisionAdapter
from .vit import ViTAdapter

__all__ = [
    "ADAPTERS",
    "ArchitectureAdapter",
    "AttentionBlock",
    "BertAdapter",
    "ClipTextAdapter",
    "ClipVisionAdapter",
    "DebertaV2Adapter",
    "DecoderAdapter",
    "Dinov2Adapter",
    "DistilBertAdapter",
    "DualEncoderAdapter",
    "MPNetAdapter",
    "ModernBertAdapter",
    "Siglip2TextAdapter",
    "Siglip2VisionAdapter",
    "SiglipTextAdapter",
    "SiglipVisionAdapter",
    "UnsupportedModelError",
    "ViTAdapter",
    "WholeAttentionAdapter",
    "ZeroHeadAttention",
    "get_adapter",
    "last_token_configs",
    "model_configs",
    "pools_last_token",
    "register_adapter",
    "supported_families",
]

ADAPTERS.extend(
    [
        DualEncoderAdapter,
        BertAdapter,
        DistilBertAdapter,
        MPNetAdapter,
        ViTAdapter,
        Dinov2Adapter,
        ClipVisionAdapter,
        ClipTextAdapter,
        SiglipVisionAdapter,
        SiglipTextAdapter,
        Siglip2VisionAdapter,
        Siglip2TextAdapter,
        DebertaV2Adapter,
        ModernBertAdapter,
        DecoderAdapter,
    ]
)


def model_configs(models) -> list:
    """The configurations of a model, of the members of an ensemble, or of a list of models."""
    if isinstance(models, (list, tuple)):
        return [c for m in models for c in model_configs(m)]
    members = getattr(models, "members", None)
    found = [models.config] if getattr(models, "config", None) is not None else []
    if isinstance(members, nn.ModuleList):
        found += [c for m in members for c in model_configs(m)]
    return found


def last_token_configs(models) -> list:
    """The configurations, among ``models``' (a model, an ensemble or a list), of those that pool
    the last token that is not ``config.pad_token_id`` (none for models that pool otherwise)."""
    return [c for c in model_configs(models) if pools_last_token(c)]
