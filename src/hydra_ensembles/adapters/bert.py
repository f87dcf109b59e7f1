"""BERT family: BertModel, BertForSequenceClassification and friends (MiniLM is a BERT)."""

from __future__ import annotations

from torch import nn

from .base import ArchitectureAdapter, AttentionBlock, ZeroHeadAttention


class BertAdapter(ArchitectureAdapter):
    """``encoder.layer[i].attention.self.{query,key,value}`` + ``attention.output.dense``."""

    family = "BERT"
    model_types = ("bert",)

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        attention = self.layers(model)[layer].attention
        core = attention.self
        head_dim = int(model.config.hidden_size // model.config.num_attention_heads)
        return AttentionBlock(
            layer=layer,
            query=core.query,
            key=core.key,
            value=core.value,
            output=attention.output.dense,
            num_heads=core.query.out_features // head_dim,
            head_dim=head_dim,
        )

    @property
    def embeddings_path(self) -> str:
        return f"{self.prefix}embeddings"

    @property
    def head_paths(self) -> tuple[str, ...]:
        return (f"{self.prefix}pooler", "classifier")

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
