"""ViT family: ViT and DeiT (same module layout), base models and image classifiers."""

from __future__ import annotations

from .base import WholeAttentionAdapter


class ViTAdapter(WholeAttentionAdapter):
    """``layers[i].attention.{q,k,v,o}_proj`` (``encoder.layer`` in older releases)."""

    family = "ViT"
    model_types = ("vit", "deit")
    projection_paths = ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj")
    head_modules = ("classifier", "cls_classifier", "distillation_classifier")  # DeiT's teacher variant
