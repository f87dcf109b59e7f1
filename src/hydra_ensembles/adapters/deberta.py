"""DeBERTa-v2 and DeBERTa-v3 (``deberta-v2``): BERT's layout with disentangled attention.

A head's score adds content-to-position and position-to-content terms: its query and key
against the relative positions (one table shared by all layers, ``encoder.rel_embeddings``,
layer-normed) projected by the layer's own W_K and W_Q (v3: ``share_att_key``) or by separate
position projections (``pos_key_proj``, ``pos_query_proj``), whose rows of the kept heads a
pruned layer keeps too. The fused attention is `layers.FusedDisentangledAttention`; members whose
position tables fine-tuning changed keep their own (`layers.MemberTable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InputError, UnsupportedModelError
from ..layers import FusedDisentangledAttention
from .base import ZeroHeadAttention, slice_linear
from .bert import BertAdapter

HEADS_ATTRIBUTE = "hydra_heads"
"""The original heads a pruned DeBERTa attention holds, in order (its position projections' rows)."""
POSITION_PROJECTIONS = {"c2p": "pos_key_proj", "p2c": "pos_query_proj"}


def _held(core: nn.Module) -> list[int]:
    return list(getattr(core, HEADS_ATTRIBUTE, range(core.num_attention_heads)))


def _rows(positions: Sequence[int], head_dim: int) -> torch.Tensor | None:
    """The rows of the heads at ``positions`` (``None``: no head)."""
    if not positions:
        return None
    return torch.cat([torch.arange(p * head_dim, (p + 1) * head_dim) for p in positions])


class DebertaV2Adapter(BertAdapter):
    """``encoder.layer[i].attention.self.{query,key,value}_proj`` + ``attention.output.dense``."""

    family = "DeBERTa-v2/v3"
    model_types = ("deberta-v2",)
    first_token_classifiers = ()
    projection_paths = (
        "attention.self.query_proj",
        "attention.self.key_proj",
        "attention.self.value_proj",
        "attention.output.dense",
    )
    head_modules = ("pooler", "classifier")
    position_tables = (("encoder.rel_embeddings", "encoder.LayerNorm"),)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if getattr(self.encoder_config(model), "conv_kernel_size", 0):
            raise UnsupportedModelError(
                "DeBERTa-v2 with a convolution after the first layer (conv_kernel_size > 0, as in "
                "deberta-v2-xlarge) is not supported"
            )

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        attention = self.layers(model)[layer].attention
        attention.output.dense = output
        core = attention.self
        if num_heads == 0:
            attention.self = ZeroHeadAttention({"query_proj": query, "key_proj": key, "value_proj": value})
            return
        if isinstance(core, ZeroHeadAttention):
            raise InputError(f"layer {layer} keeps no heads; heads cannot be added back")
        if heads is None or len(heads) != num_heads:
            raise InputError(f"DeBERTa layer {layer}: name the {num_heads} original heads kept (heads=...)")
        held = _held(core)
        rows = _rows([held.index(h) for h in heads], core.attention_head_size)
        for name in POSITION_PROJECTIONS.values():
            if isinstance(getattr(core, name, None), nn.Linear):
                setattr(core, name, slice_linear(getattr(core, name), rows, dim=0))
        core.query_proj, core.key_proj, core.value_proj = query, key, value
        core.num_attention_heads = num_heads
        core.all_head_size = num_heads * core.attention_head_size
        setattr(core, HEADS_ATTRIBUTE, list(heads))

    def fused_settings(self, model: nn.Module, layer: int) -> tuple[type[nn.Module], dict]:
        """DeBERTa's position settings, read from the config as ``DisentangledSelfAttention`` does."""
        config = self.encoder_config(model)
        relative = bool(getattr(config, "relative_attention", False))
        span = int(getattr(config, "max_relative_positions", -1))
        span = span if span >= 1 else int(config.max_position_embeddings)
        buckets = int(getattr(config, "position_buckets", -1))
        return FusedDisentangledAttention, {
            "pos_att_type": tuple(config.pos_att_type or ()) if relative else (),
            "share_att_key": bool(getattr(config, "share_att_key", False)),
            "span": buckets if buckets > 0 else span,
            "position_dropout": float(getattr(config, "hidden_dropout_prob", 0.0)),
        }

    def fused_attention(self, model, layer, projections, heads, bias_stride=0, sources=()) -> nn.Module:
        fused = super().fused_attention(model, layer, projections, heads, bias_stride, sources)
        for kind, name in POSITION_PROJECTIONS.items():
            if not fused.share_att_key and kind in fused.pos_att_type:
                linears = [
                    self._position_projection(s, layer, name, h) for s, h in zip(sources, heads, strict=True)
                ]
                fused.set_position_projections(name.removesuffix("_proj"), linears)
        return fused

    def _position_projection(
        self, source: nn.Module, layer: int, name: str, heads: Sequence[int]
    ) -> nn.Linear:
        """``source``'s position projection ``name`` of ``layer``, keeping original ``heads``."""
        core = self.layers(source)[layer].attention.self
        if isinstance(core, ZeroHeadAttention):  # keeps no heads: no rows to take
            return slice_linear(core.query_proj, None, dim=0)
        rows = _rows([_held(core).index(h) for h in heads], core.attention_head_size)
        return slice_linear(getattr(core, name), rows, dim=0)
