"""ViT family: ViTModel and ViTForImageClassification."""

from __future__ import annotations

from torch import nn

from .base import ArchitectureAdapter, AttentionBlock, ZeroHeadAttention


class ViTAdapter(ArchitectureAdapter):
    """``layers[i].attention.{q,k,v,o}_proj`` (``encoder.layer`` in older releases)."""

    family = "ViT"
    model_types = ("vit",)

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        attention = self.layers(model)[layer].attention
        config = model.config
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        return AttentionBlock(
            layer=layer,
            query=attention.q_proj,
            key=attention.k_proj,
            value=attention.v_proj,
            output=attention.o_proj,
            num_heads=attention.q_proj.out_features // head_dim,
            head_dim=head_dim,
        )

    @property
    def embeddings_path(self) -> str:
        return f"{self.prefix}embeddings"

    @property
    def head_paths(self) -> tuple[str, ...]:
        return (f"{self.prefix}pooler", "classifier")

    def set_attention(self, model, layer, query, key, value, output, num_heads) -> None:
        block = self.layers(model)[layer]
        projections = {"q_proj": query, "k_proj": key, "v_proj": value, "o_proj": output}
        if num_heads == 0:
            block.attention = ZeroHeadAttention(projections, output_name="o_proj")
            return
        if isinstance(block.attention, ZeroHeadAttention):
            raise ValueError(f"layer {layer} keeps no heads; heads cannot be added back")
        for name, module in projections.items():
            setattr(block.attention, name, module)
        block.attention.num_attention_heads = num_heads

    def install_fused_attention(self, model, layer, fused) -> None:
        self.layers(model)[layer].attention = fused

    def attention_paths(self, layer: int) -> tuple[str, ...]:
        return (f"{self.layers_path}.{layer}.attention",)
