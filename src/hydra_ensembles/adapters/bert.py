"""BERT family: BERT (MiniLM is a BERT), RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA, which share
BERT's module layout (base models and task models, e.g. ``RobertaForSequenceClassification``)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InputError
from .base import ArchitectureAdapter, ZeroHeadAttention


class FirstQueryAttention(nn.Module):
    """A BERT self-attention computing the first token's output only: its query against the
    keys and values of all tokens (the other queries are never read when only [CLS] is)."""

    def __init__(self, core: nn.Module) -> None:
        super().__init__()
        self.core = core

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        core = self.core
        shape = (hidden_states.shape[0], -1, core.num_attention_heads, core.attention_head_size)
        query = core.query(hidden_states[:, :1]).view(shape).transpose(1, 2)
        key = core.key(hidden_states).view(shape).transpose(1, 2)
        value = core.value(hidden_states).view(shape).transpose(1, 2)
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask[..., :1, :]  # (B, 1, T, T) -> the first query's row
        context = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=core.scaling
        )
        return context.transpose(1, 2).flatten(-2), None


class BertAdapter(ArchitectureAdapter):
    """``encoder.layer[i].attention.self.{query,key,value}`` + ``attention.output.dense``."""

    family = "BERT"
    model_types = ("bert", "roberta", "xlm-roberta", "camembert", "electra")
    input_modules = ("embeddings_project",)  # ELECTRA, where embedding_size != hidden_size
    first_token_classifiers: tuple[str, ...] = tuple(
        f"{name}ForSequenceClassification"
        for name in ("Bert", "Roberta", "XLMRoberta", "Camembert", "Electra")
    )
    """Task models whose head reads only the first token of the last layer."""
    projection_paths = (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
    )

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        attention = self.layers(model)[layer].attention
        attention.output.dense = output
        if num_heads == 0:
            attention.self = ZeroHeadAttention({"query": query, "key": key, "value": value})
            return
        if isinstance(attention.self, ZeroHeadAttention):
            raise InputError(f"layer {layer} keeps no heads; heads cannot be added back")
        core = attention.self
        core.query, core.key, core.value = query, key, value
        core.num_attention_heads = num_heads
        core.all_head_size = num_heads * core.attention_head_size

    def install_fused_attention(self, model, layer, fused) -> None:
        attention = self.layers(model)[layer].attention
        attention.self = fused
        attention.output.dense = nn.Identity()  # the fused module applies W_O and its bias

    def attention_paths(self, layer: int) -> tuple[str, ...]:
        root = f"{self.layers_path}.{layer}.attention"
        return (f"{root}.self", f"{root}.output.dense")

    def attention_core_path(self, layer: int) -> str | None:
        return f"{self.layers_path}.{layer}.attention.self"

    def first_token_only(self, model: nn.Module) -> ExitStack | None:
        """The sequence classifiers' heads (BERT's pooler, RoBERTa's classification head) read
        token 0 of the last layer only: that layer's attention computes the first query only
        (`FirstQueryAttention`), and its W_O, LayerNorm and MLP see that token only (the
        residual is sliced to it)."""
        if type(model).__name__ not in self.first_token_classifiers:
            return None
        attention = self.layers(model)[-1].attention
        output = getattr(attention, "output", None)
        if output is None or not isinstance(getattr(output, "dense", None), nn.Linear):
            return None
        undo = ExitStack()
        undo.callback(
            output.register_forward_pre_hook(lambda _m, args: (args[0][:, :1], args[1][:, :1])).remove
        )
        core = attention.self
        if all(hasattr(core, a) for a in ("query", "key", "value", "scaling", "num_attention_heads")):
            attention.self = FirstQueryAttention(core)
            undo.callback(setattr, attention, "self", core)
        return undo
