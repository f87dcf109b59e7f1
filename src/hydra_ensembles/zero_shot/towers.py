"""Encoder towers of a dual encoder: a Hugging Face encoder plus how it pools an embedding.

A tower's embedding is what the dual encoder compares by cosine similarity: the mean of the
token states under the attention mask for sentence-transformers checkpoints (their pooling),
or the projected embedding of a CLIP tower (``image_embeds`` / ``text_embeds``), or a SigLIP
tower's ``pooler_output`` (``image_pooler``: its attention-pooling head; ``text_pooler``: its last
token's projection).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..errors import InputError

Pooling = Literal["mean", "cls", "image_embeds", "text_embeds", "image_pooler", "text_pooler"]
POOLINGS = ("mean", "cls", "image_embeds", "text_embeds", "image_pooler", "text_pooler")


def pool(outputs: Any, inputs: dict[str, Any], pooling: str) -> torch.Tensor:
    """The embedding (..., B, D) from a tower's outputs (a model output or a dict of tensors
    with any leading member dimensions, e.g. a fused model's (M, B, ...))."""
    if pooling in ("image_embeds", "text_embeds"):
        return outputs[pooling]
    if pooling in ("image_pooler", "text_pooler"):
        return outputs["pooler_output"]
    hidden = outputs["last_hidden_state"]
    if pooling == "cls":
        return hidden[..., 0, :]
    if pooling != "mean":
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    mask = inputs.get("attention_mask")
    if mask is None:
        return hidden.mean(-2)
    weights = mask.to(hidden.dtype)[..., None]  # (B, T, 1): broadcasts over member dimensions
    # sentence-transformers' mean pooling: sum over unmasked tokens / their count (clamped)
    return (hidden * weights).sum(-2) / weights.sum(-2).clamp_min(1e-9)


class EncoderTower(nn.Module):
    """One tower: ``model`` (a Hugging Face encoder) and its ``pooling``."""

    def __init__(self, model: nn.Module, pooling: str) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.model = model
        self.pooling = pooling

    def forward(self, **inputs: Any) -> torch.Tensor:
        """Unnormalised embeddings (B, D)."""
        return pool(self.model(**inputs), inputs, self.pooling)

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}"


def cosine_logits(
    inputs: torch.Tensor, classes: torch.Tensor, scale: float, bias: float = 0.0
) -> torch.Tensor:
    """``scale`` x cosine similarity (+ ``bias``) of inputs (..., B, D) and classes (..., C, D) ->
    (..., B, C).

    Computed in float32 (float64 where either side is float64) with autocast off, whatever the
    dtypes of the two sides (a bf16 model's embeddings meet fp32 cached class embeddings, or the
    reverse): a bf16 matmul would round cosines near 1 to steps of 2^-8, i.e. logits to steps of
    ``scale`` / 256.
    """
    dtype = torch.float64 if torch.float64 in (inputs.dtype, classes.dtype) else torch.float32
    with torch.autocast(inputs.device.type, enabled=False):
        a = torch.nn.functional.normalize(inputs.to(dtype), dim=-1)
        logits = scale * a @ classes.to(dtype).transpose(-1, -2)
        return logits + bias if bias else logits


def normalize(embeddings: torch.Tensor) -> torch.Tensor:
    """Unit-length rows (in float32 at least: cosine similarities of low-precision vectors drift)."""
    x = embeddings.float() if embeddings.dtype in (torch.float16, torch.bfloat16) else embeddings
    return torch.nn.functional.normalize(x, dim=-1)
