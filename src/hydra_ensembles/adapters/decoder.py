"""Decoder LLM classifiers with grouped-query attention: Llama, Mistral, Qwen2, Qwen3 (with q/k
norms), Gemma, Gemma 2 (logit soft-capping, sliding windows) and Gemma 3's text model, as their
``...ForSequenceClassification`` (causal attention, the last non-padding token pooled by ``score``).

A head set names query heads. Query head h reads key/value head ``h // group``; a key/value head
is removed only when every query head of its group is, and the kept query heads keep reading
their own key/value head (`IndexedKVAttention`, which runs the family's own forward).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from ..errors import InputError
from ..layers.grouped import GroupedLinear, PerMemberModule
from ..layers.indexed_kv import IndexedKVAttention
from .base import AttentionBlock, WholeAttentionAdapter, ZeroHeadAttention

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def kv_heads(heads: Sequence[int], group: int) -> tuple[list[int], list[int]]:
    """The key/value heads that original query ``heads`` read (groups of ``group``), in order,
    and for each query head the position of its key/value head among them."""
    kept = sorted({h // group for h in heads})
    return kept, [kept.index(h // group) for h in heads]


class DecoderAdapter(WholeAttentionAdapter):
    """``model.layers[i].self_attn.{q,k,v,o}_proj`` with ``num_key_value_heads`` key/value heads."""

    family = "Decoder LLM (grouped-query attention)"
    model_types = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
    projection_paths = tuple(f"self_attn.{name}" for name in PROJECTIONS)
    head_modules = ("score",)
    embeddings_module = "embed_tokens"
    last_token_pooling = True
    head_reads_inputs = True
    call_options: ClassVar[dict[str, object]] = {"use_cache": False}

    def group_size(self, model: nn.Module) -> int:
        """Query heads per key/value head in the unpruned model."""
        config = self.encoder_config(model)
        return int(config.num_attention_heads) // int(
            config.num_key_value_heads or config.num_attention_heads
        )

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        block = super().attention_block(model, layer)
        attention = self._attention(model, layer)
        index = getattr(attention, "kv_index", None)
        if isinstance(index, torch.Tensor):
            if index.shape[0] != 1:
                raise InputError(f"layer {layer} holds {index.shape[0]} fused members, not one model's heads")
            return replace(block, kv_index=tuple(index[0].tolist()))
        group = block.num_heads // max(1, block.key.out_features // block.head_dim)
        return replace(block, kv_index=tuple(h // max(1, group) for h in range(block.num_heads)))

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        block = self.layers(model)[layer]
        attention = self._attention(model, layer)
        projections = dict(zip(PROJECTIONS, (query, key, value, output), strict=True))
        if num_heads == 0:
            others = {n: m for n, m in attention.named_children() if n not in projections}
            block.set_submodule(self._attention_name, ZeroHeadAttention({**projections, **others}, "o_proj"))
            return
        if isinstance(attention, ZeroHeadAttention):
            raise InputError(f"layer {layer} keeps no heads; heads cannot be added back")
        if heads is None or len(heads) != num_heads:
            raise InputError(f"layer {layer}: name the {num_heads} original query heads kept (heads=...)")
        kept, index = kv_heads(heads, self.group_size(model))
        pruned = IndexedKVAttention(attention, projections, torch.tensor([index]), [num_heads], [len(kept)])
        block.set_submodule(self._attention_name, pruned)

    def fused_attention(self, model, layer, projections, heads, bias_stride=0, sources=()) -> nn.Module:
        """Members' query heads against their own key/value heads: one `IndexedKVAttention` over
        `GroupedLinear` projections (q/k norms per member where the family has them)."""
        if not any(heads):
            return super().fused_attention(model, layer, projections, heads, bias_stride, sources)
        fused = self._empty_fused(model, layer, heads, sources)
        with torch.no_grad():
            for m, linears in enumerate(projections):
                for name, linear in zip(PROJECTIONS, linears, strict=True):
                    target = getattr(fused, name)
                    rows, cols = linear.weight.shape
                    target.weight[m, :rows, :cols] = linear.weight
                    if linear.bias is not None:
                        target.bias[m, : linear.bias.shape[0]] = linear.bias
        return fused

    def empty_fused_attention(self, model, layer, heads, bias_stride=0) -> nn.Module:
        if not any(heads):
            return super().empty_fused_attention(model, layer, heads, bias_stride)
        return self._empty_fused(model, layer, heads, ())

    def _empty_fused(self, model, layer, heads, sources) -> IndexedKVAttention:
        """The fused module for members keeping ``heads`` (original query heads), its weights
        zero; the attention's other sub-modules (q/k norms) are the members' in ``sources``, one
        copy per member (the model's own where no sources are given)."""
        group, dh, m = self.group_size(model), self.head_dim(model), len(heads)
        plans = [kv_heads(h, group) for h in heads]
        h_max, kv_max = max(len(h) for h in heads), max(len(kept) for kept, _ in plans)
        kv_index = torch.zeros(m, h_max, dtype=torch.long)
        for member, (_, index) in enumerate(plans):
            kv_index[member, : len(index)] = torch.tensor(index, dtype=torch.long)
        template = self._template(model, layer, sources)
        modules: dict[str, nn.Module] = {}
        for name, width in zip(PROJECTIONS, (h_max, kv_max, kv_max, h_max), strict=True):
            linear = getattr(template, name)
            inputs, outputs = (
                (width * dh, linear.out_features) if name == "o_proj" else (linear.in_features, width * dh)
            )
            grouped = GroupedLinear(
                m, inputs, outputs, linear.bias is not None, linear.weight.device, linear.weight.dtype
            )
            for param in grouped.parameters():
                nn.init.zeros_(param)
            modules[name] = grouped
        for name, child in template.named_children():
            if name not in PROJECTIONS and list(child.parameters()):
                peers = [self._attention(source, layer).get_submodule(name) for source in sources] or [
                    child
                ] * m
                modules[name] = (
                    PerMemberModule([copy.deepcopy(p) for p in peers]) if m > 1 else copy.deepcopy(peers[0])
                )
        kv_counts = [len(kept) for kept, _ in plans]
        fused = IndexedKVAttention(template, modules, kv_index, [len(h) for h in heads], kv_counts)
        return fused.train(template.training)

    def _attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.layers(model)[layer].get_submodule(self._attention_name)

    def _template(self, model: nn.Module, layer: int, sources: Sequence[nn.Module]) -> nn.Module:
        """A layer's attention module that keeps heads (the family's own, or a pruned one), from
        ``model`` or else from the first source that has one."""
        for candidate in (model, *sources):
            attention = self._attention(candidate, layer)
            if not isinstance(attention, ZeroHeadAttention):
                return attention
        raise InputError(f"layer {layer}: no member keeps a head, there is no attention to copy")
