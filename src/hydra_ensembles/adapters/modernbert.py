"""ModernBERT (``modernbert``): W_Q, W_K and W_V packed in one linear (``Wqkv``: [Q | K | V]),
rotary position embeddings, and global layers alternating with sliding-window local ones.

ModernBERT's attention takes its head count from ``Wqkv``'s shape, so a pruned layer is the
same module with ``Wqkv`` keeping the kept heads' rows of each of Q, K and V (and ``Wo`` their
columns), and M fused members are that module over `GroupedLinear` projections
(`layers.FusedQKVAttention`): rotary embeddings, the local windows' masks and the attention
function are ModernBERT's own.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError
from ..layers import FusedQKVAttention, GroupedLinear
from .base import AttentionBlock, WholeAttentionAdapter, ZeroHeadAttention, slice_linear


def _packed(query: nn.Linear, key: nn.Linear, value: nn.Linear) -> nn.Linear:
    """One linear computing [query | key | value]."""
    if query.out_features == 0:  # no heads: no rows
        return slice_linear(query, None, dim=0)
    weight = query.weight
    packed = nn.Linear(
        weight.shape[1], 3 * weight.shape[0], query.bias is not None, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        packed.weight.copy_(torch.cat([query.weight, key.weight, value.weight]))
        if packed.bias is not None:
            packed.bias.copy_(torch.cat([query.bias, key.bias, value.bias]))
    packed.train(query.training)
    packed.weight.requires_grad_(query.weight.requires_grad)
    return packed


class ModernBertAdapter(WholeAttentionAdapter):
    """``model.layers[i].attn.{Wqkv,Wo}``; the classifier pools [CLS] or the masked mean."""

    family = "ModernBERT"
    model_types = ("modernbert",)
    projection_paths = ("attn.Wqkv", "attn.Wqkv", "attn.Wqkv", "attn.Wo")
    head_modules = ("head", "classifier")
    head_reads_inputs = True  # the mean pooling reads the attention mask

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        attention = self.layers(model)[layer].attn
        packed, head_dim = attention.Wqkv, self.head_dim(model)
        width = packed.out_features // 3
        q, k, v = (
            slice_linear(packed, torch.arange(i * width, (i + 1) * width) if width else None, dim=0)
            for i in range(3)
        )
        return AttentionBlock(
            layer, q, k, v, attention.Wo, width // head_dim, head_dim, packed_qkv=packed.weight
        )

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        block = self.layers(model)[layer]
        packed = _packed(query, key, value)
        if num_heads == 0:
            block.attn = ZeroHeadAttention({"Wqkv": packed, "Wo": output}, output_name="Wo")
            return
        if isinstance(block.attn, ZeroHeadAttention):
            raise InputError(f"layer {layer} keeps no heads; heads cannot be added back")
        block.attn.Wqkv, block.attn.Wo = packed, output

    def fused_attention(self, model, layer, projections, heads, bias_stride=0, sources=()) -> nn.Module:
        if not any(heads):
            return super().fused_attention(model, layer, projections, heads, bias_stride, sources)
        fused = self._empty_fused(model, layer, heads)
        width = max(len(h) for h in heads) * self.head_dim(model)
        with torch.no_grad():
            for m, (q, k, v, o) in enumerate(projections):
                rows = q.out_features
                for i, linear in enumerate((q, k, v)):
                    fused.Wqkv.weight[m, i * width : i * width + rows] = linear.weight
                    if linear.bias is not None:
                        fused.Wqkv.bias[m, i * width : i * width + rows] = linear.bias
                fused.Wo.weight[m, :, :rows] = o.weight
                if o.bias is not None:
                    fused.Wo.bias[m] = o.bias
        return fused

    def empty_fused_attention(self, model, layer, heads, bias_stride=0) -> nn.Module:
        if not any(heads):
            return super().empty_fused_attention(model, layer, heads, bias_stride)
        return self._empty_fused(model, layer, heads)

    def _empty_fused(self, model: nn.Module, layer: int, heads) -> FusedQKVAttention:
        """ModernBERT's attention over M members' padded heads (weights zero)."""
        from transformers.models.modernbert.modeling_modernbert import ModernBertAttention

        config = self.encoder_config(model)
        template = ModernBertAttention(config, layer_idx=layer)
        reference = next(model.parameters())
        width, hidden, m = max(len(h) for h in heads) * self.head_dim(model), config.hidden_size, len(heads)
        factory = {"device": reference.device, "dtype": reference.dtype}
        modules = {
            "Wqkv": GroupedLinear(m, hidden, 3 * width, bool(config.attention_bias), **factory),
            "Wo": GroupedLinear(m, width, hidden, bool(config.attention_bias), **factory),
        }
        for module in modules.values():
            for param in module.parameters():
                nn.init.zeros_(param)
        fused = FusedQKVAttention(template, modules, [len(h) for h in heads])
        return fused.train(model.training)
