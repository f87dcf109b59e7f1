"""ViT family: ViT and DeiT (same module layout), base models and image classifiers."""

from __future__ import annotations

from .base import ArchitectureAdapter, ZeroHeadAttention


class ViTAdapter(ArchitectureAdapter):
    """``layers[i].attention.{q,k,v,o}_proj`` (``encoder.layer`` in older releases)."""

    family = "ViT"
    model_types = ("vit", "deit")
    projection_paths = ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj")
    head_modules = ("classifier", "cls_classifier", "distillation_classifier")  # DeiT's teacher variant

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
