"""SigLIP family: the vision tower with a classifier (``SiglipForImageClassification``), the bare
towers (``SiglipVisionModel``, ``SiglipTextModel``, what a SigLIP dual encoder is made of).
SigLIP2's variable-resolution inputs are not supported."""

from __future__ import annotations

from torch import nn

from .base import WholeAttentionAdapter


class SiglipVisionAdapter(WholeAttentionAdapter):
    """``vision_model.encoder.layers[i].self_attn.{q,k,v,out}_proj``, as CLIP's; no class token
    (the classifier mean-pools the patches). The attention-pooling head (``vision_model.head``,
    a ``nn.MultiheadAttention`` over the last layer's patches) belongs to the task head: it is
    never pruned (``head`` on the bare tower)."""

    family = "SigLIP (vision)"
    model_types = ("siglip", "siglip_vision_model")
    projection_paths = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.out_proj",
    )
    heads_attribute = "num_heads"
    towers = ("vision_model",)
    head_modules = ("classifier", "vision_model.head", "head")

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        """The vision tower only: a full ``SiglipModel`` (text and vision) is not a classifier."""
        return super().matches(model) and not hasattr(model, "text_model")

    def encoder_config(self, model: nn.Module):
        return getattr(model.config, "vision_config", model.config)


class SiglipTextAdapter(SiglipVisionAdapter):
    """SigLIP's text tower (``SiglipTextModel``): the same attention modules; it pools the last
    token (prompts are padded to the full length) through ``head``, a linear projection."""

    family = "SigLIP (text)"
    model_types = ("siglip_text_model",)
    towers = ("text_model",)
    head_modules = ("head",)

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return WholeAttentionAdapter.matches.__func__(cls, model)

    def encoder_config(self, model: nn.Module):
        return getattr(model.config, "text_config", model.config)
