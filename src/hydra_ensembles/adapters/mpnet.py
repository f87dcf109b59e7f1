"""MPNet family (all-mpnet-base-v2 and other sentence encoders): MPNetModel and its task models.

MPNet's attention adds a relative position bias with one channel per head, computed once by the
encoder from a table shared by all layers (``encoder.relative_attention_bias``) and handed to
every layer as ``position_bias`` (B, H, T, T). A layer that keeps a subset of its heads must add
the channels of *those* heads: a pruned layer's attention (`KeptHeadsSelfAttention`) selects
them before Hugging Face's own forward runs, and the fused attention selects each member's
(`FusedMultiHeadAttention`'s ``heads``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InputError
from .base import WholeAttentionAdapter


class KeptHeadsSelfAttention(nn.Module):
    """MPNet self-attention keeping the original heads ``heads``: Hugging Face's forward
    (``MPNetSelfAttention.forward``, imported when first run: importing the package stays
    light), given the position bias of those heads only."""

    def __init__(self, core: nn.Module, heads: Sequence[int]) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = core.q, core.k, core.v, core.o
        self.dropout = core.dropout
        self.attention_head_size = core.attention_head_size
        self.num_attention_heads = len(heads)
        self.all_head_size = len(heads) * core.attention_head_size
        self.register_buffer("heads", torch.tensor(list(heads), dtype=torch.long), persistent=False)

    def forward(
        self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs
    ):
        from transformers.models.mpnet.modeling_mpnet import MPNetSelfAttention

        if position_bias is not None:
            position_bias = position_bias.index_select(1, self.heads.to(position_bias.device))
        return MPNetSelfAttention.forward(
            self, hidden_states, attention_mask, position_bias, output_attentions, **kwargs
        )

    def extra_repr(self) -> str:
        return f"heads={self.heads.tolist()}"


class MPNetAdapter(WholeAttentionAdapter):
    """``encoder.layer[i].attention.attn.{q,k,v,o}``; W_O lives inside the attention module."""

    family = "MPNet"
    model_types = ("mpnet",)
    projection_paths = ("attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o")
    head_modules = ("classifier",)
    head_bias_tables = ("encoder.relative_attention_bias",)

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        super().set_attention(model, layer, query, key, value, output, num_heads, heads)
        if num_heads == 0:
            return
        if heads is None or len(heads) != num_heads:
            raise InputError(f"MPNet layer {layer}: name the {num_heads} original heads kept (heads=...)")
        block = self.layers(model)[layer]
        core = block.get_submodule(self._attention_name)
        core.all_head_size = num_heads * core.attention_head_size
        block.set_submodule(self._attention_name, KeptHeadsSelfAttention(core, heads))
