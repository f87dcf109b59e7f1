"""SigLIP family: the vision tower with a classifier (``SiglipForImageClassification``), the bare
towers (``SiglipVisionModel``, ``SiglipTextModel``, what a SigLIP dual encoder is made of), and
SigLIP 2's (variable-resolution images: patchified ``pixel_values`` with ``pixel_attention_mask``
and ``spatial_shapes``, which the library passes through like any other input)."""

from __future__ import annotations

from torch import nn

from .clip import ClipTextAdapter, ClipVisionAdapter


class SiglipVisionAdapter(ClipVisionAdapter):
    """``vision_model.encoder.layers[i].self_attn.{q,k,v,out}_proj``, as CLIP's; no class token
    (the classifier mean-pools the patches), no layer norm before the layers. The
    attention-pooling head (``vision_model.head``, a ``nn.MultiheadAttention`` over the last
    layer's patches) belongs to the task head: it is never pruned (``head`` on the bare tower)."""

    family = "SigLIP (vision)"
    model_types = ("siglip", "siglip_vision_model")
    input_modules = ()
    head_modules = ("classifier", "vision_model.head", "head")


class SiglipTextAdapter(ClipTextAdapter):
    """SigLIP's text tower (``SiglipTextModel``): CLIP's attention modules; it pools the last
    token (prompts are padded to the full length) through ``head``, a linear projection."""

    family = "SigLIP (text)"
    model_types = ("siglip_text_model",)
    head_modules = ("head",)

    def encoder_config(self, model: nn.Module):
        return getattr(model.config, "text_config", model.config)


class Siglip2VisionAdapter(SiglipVisionAdapter):
    """SigLIP 2's vision tower (``Siglip2ForImageClassification``, ``Siglip2VisionModel``): SigLIP's
    modules; images come as patches, padded ones masked in attention and in the mean pooling."""

    family = "SigLIP 2 (vision)"
    model_types = ("siglip2", "siglip2_vision_model")
    head_reads_inputs = True


class Siglip2TextAdapter(SiglipTextAdapter):
    """SigLIP 2's text tower (``Siglip2TextModel``)."""

    family = "SigLIP 2 (text)"
    model_types = ("siglip2_text_model",)
