"""Checks of the batches a model is given, before any work: not empty, labelled within the
model's classes, and padded as the model reads padding (a decoder classifier pools the last token
that is not its padding id)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .adapters import last_token_configs

__all__ = ["check_padding", "checked_batches"]


def checked_batches(
    batches: Iterable[dict[str, Any]],
    what: str,
    num_labels: int | None = None,
    error: type = ValueError,
    *,
    model: Any = None,
) -> list[dict[str, Any]]:
    """``batches`` as a non-empty list; with ``num_labels``, every batch labelled within the
    model's classes (labels (B,) or, for MIMO, (B, M)); with ``model``, padded as it reads padding
    (`check_padding`). Raises ``error`` naming ``what``."""
    batches = list(batches)
    if not batches:
        raise error(f"{what} is empty: give at least one {'labelled ' if num_labels else ''}batch")
    if model is not None:
        check_padding(batches, model, what, error)
    if num_labels is None:
        return batches
    for batch in batches:
        if "labels" not in batch:
            raise error(f"every batch of {what} needs 'labels'")
        labels = batch["labels"]
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
            kind = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise error(f"labels in {what} must be an integer tensor of class ids, got {kind}")
        if labels.numel() and (labels.min() < 0 or labels.max() >= num_labels):
            raise error(f"labels out of range in {what}: the model has {num_labels} classes")
    return batches


def check_padding(batches: list[dict[str, Any]], model: Any, what: str, error: type = ValueError) -> None:
    """Refuse batches that ``model`` (a model, an ensemble or a list) would misread: a decoder
    classifier pools the last token that is not ``config.pad_token_id``, so a padded position
    (``attention_mask`` 0) holding another id would be read as the input's last token, and
    without a padding id it reads the last position, padding or not. Other models pass."""
    pads = {config.pad_token_id for config in last_token_configs(model)}
    for batch in batches if pads else ():
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if ids is None or mask is None or bool((mask != 0).all()):
            continue
        if None in pads:
            raise error(
                f"{what} is padded but the model names no config.pad_token_id: its last-token "
                "pooling would read padding (set the padding id the data is padded with)"
            )
        for pad in pads:
            wrong = (mask == 0) & (ids != pad)
            if bool(wrong.any()):
                raise error(
                    f"{what} is padded with token id {int(ids[wrong][0])} but the model's last-token "
                    f"pooling looks for config.pad_token_id {pad}: it would read padding as the "
                    "input's end (pad with that id; data.align_padding does for a tokenizer)"
                )
