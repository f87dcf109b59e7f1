"""CLIP family: the vision tower (``CLIPVisionModel``, ``CLIPVisionModelWithProjection``) and
``CLIPForImageClassification`` (a CLIP checkpoint's vision tower with a classifier)."""

from __future__ import annotations

from torch import nn

from .base import WholeAttentionAdapter


class ClipVisionAdapter(WholeAttentionAdapter):
    """``encoder.layers[i].self_attn.{q,k,v,out}_proj``; W_O lives inside the attention module."""

    family = "CLIP (vision)"
    model_types = ("clip", "clip_vision_model")
    projection_paths = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
    )
    heads_attribute = "num_heads"
    towers = ("vision_model",)
    input_modules = ("pre_layrnorm",)  # runs between the embeddings and the first layer

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """The vision tower only: a full model with both towers (``CLIPModel``) is not a classifier."""
        return super().matches(model) and not hasattr(model, "text_model")

    def encoder_config(self, model: nn.Module):
        return getattr(model.config, "vision_config", model.config)


class ClipTextAdapter(ClipVisionAdapter):
    """CLIP's text tower (``CLIPTextModel``, ``CLIPTextModelWithProjection``): the same attention
    modules as the vision tower under ``text_model``; causal, pooled at the end-of-text token."""

    family = "CLIP (text)"
    model_types = ("clip_text_model",)
    towers = ("text_model",)
    input_modules = ()

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return WholeAttentionAdapter.matches.__func__(cls, model)
