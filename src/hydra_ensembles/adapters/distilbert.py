"""DistilBERT family: DistilBertModel, DistilBertForSequenceClassification and friends."""

from __future__ import annotations

from .base import ArchitectureAdapter, ZeroHeadAttention


class DistilBertAdapter(ArchitectureAdapter):
    """``transformer.layer[i].attention.{q,k,v,out}_lin``; W_O lives inside the attention module."""

    family = "DistilBERT"
    model_types = ("distilbert",)
    projection_paths = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin")
    head_modules = ("pre_classifier", "classifier")

    def set_attention(self, model, layer, query, key, value, output, num_heads) -> None:
        block = self.layers(model)[layer]
        projections = {"q_lin": query, "k_lin": key, "v_lin": value, "out_lin": output}
        if num_heads == 0:
            block.attention = ZeroHeadAttention(projections, output_name="out_lin")
            return
        if isinstance(block.attention, ZeroHeadAttention):
            raise ValueError(f"layer {layer} keeps no heads; heads cannot be added back")
        for name, module in projections.items():
            setattr(block.attention, name, module)
        block.attention.n_heads = num_heads

    def install_fused_attention(self, model, layer, fused) -> None:
        self.layers(model)[layer].attention = fused

    def attention_paths(self, layer: int) -> tuple[str, ...]:
        return (f"{self.layers_path}.{layer}.attention",)
