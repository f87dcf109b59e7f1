"""BERT family: BertModel, BertForSequenceClassification and friends (MiniLM is a BERT)."""

from __future__ import annotations

from torch import nn
from torch.utils.hooks import RemovableHandle

from .base import ArchitectureAdapter, ZeroHeadAttention


class BertAdapter(ArchitectureAdapter):
    """``encoder.layer[i].attention.self.{query,key,value}`` + ``attention.output.dense``."""

    family = "BERT"
    model_types = ("bert",)
    projection_paths = (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
    )

    def set_attention(self, model, layer, query, key, value, output, num_heads) -> None:
        attention = self.layers(model)[layer].attention
        attention.output.dense = output
        if num_heads == 0:
            attention.self = ZeroHeadAttention({"query": query, "key": key, "value": value})
            return
        if isinstance(attention.self, ZeroHeadAttention):
            raise ValueError(f"layer {layer} keeps no heads; heads cannot be added back")
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

    def first_token_only(self, model: nn.Module) -> RemovableHandle | None:
        """BertForSequenceClassification's pooler reads token 0 of the last layer only: slice the
        attention output and the residual to that token before W_O, LayerNorm and the MLP."""
        if type(model).__name__ != "BertForSequenceClassification":
            return None
        output = getattr(self.layers(model)[-1].attention, "output", None)
        if output is None or not isinstance(getattr(output, "dense", None), nn.Linear):
            return None
        return output.register_forward_pre_hook(lambda _m, args: (args[0][:, :1], args[1][:, :1]))
