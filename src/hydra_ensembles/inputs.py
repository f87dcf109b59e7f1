"""Checks of the batches a model is given, before any work: not empty, labelled within the
model's classes, and padded as the model reads padding (a decoder classifier pools the last token
that is not its padding id)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .adapters import last_token_configs
from .errors import InputError

__all__ = ["check_padding", "checked_batches", "class_ids"]


def class_ids(labels: Any, num_classes: int, what: str, error: type = InputError) -> np.ndarray:
    """``labels`` (a tensor, an array or a sequence) as int64 class ids in [0, ``num_classes``),
    shape kept: the library's one check of label arrays. Booleans, text and floating-point
    arrays (fractions and NaN truncate silently; whole ones are more often scores than ids: the
    data files' parser reads a file's "1.0" as class 1 before any array is made) are refused
    with ``error`` naming ``what``."""
    array = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):  # floats: maybe scores
        raise error(f"labels of {what} must be integer class ids, got {array.dtype}")
    ids = array.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
        raise error(f"labels out of range: there are {num_classes} classes ({what})")
    return ids


def checked_batches(
    batches: Iterable[dict[str, Any]],
    what: str,
    num_labels: int | None = None,
    error: type = InputError,
    *,
    model: Any = None,
) -> list[dict[str, Any]]:
    """``batches`` as a non-empty list; token ids, where given, of an integer type; with
    ``num_labels``, every batch labelled within the model's classes (labels (B,) or, for MIMO,
    (B, M); an integer tensor of any width, returned as int64); with ``model``, padded as it reads
    padding (`check_padding`). Raises ``error`` naming ``what``."""
    batches = list(batches)
    if not batches:
        raise error(f"{what} is empty: give at least one {'labelled ' if num_labels else ''}batch")
    for batch in batches:
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if isinstance(ids, torch.Tensor) and (
            ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
        ):
            raise error(f"input_ids in {what} must be an integer tensor of token ids, got {ids.dtype}")
    if model is not None:
        check_padding(batches, model, what, error)
    if num_labels is None:
        return batches
    checked = []
    for batch in batches:
        if "labels" not in batch:
            raise error(f"every batch of {what} needs 'labels'")
        labels = batch["labels"]
        if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
            kind = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise error(f"labels in {what} must be an integer tensor of class ids, got {kind}")
        ids = torch.from_numpy(class_ids(labels, num_labels, what, error)).to(labels.device)
        checked.append(batch if labels.dtype == torch.int64 else {**batch, "labels": ids})
    return checked


def check_padding(batches: list[dict[str, Any]], model: Any, what: str, error: type = InputError) -> None:
    """Refuse batches that ``model`` (a model, an ensemble or a list) would misread: a decoder
    classifier pools the last token that is not ``config.pad_token_id``, so a padded position
    (``attention_mask`` 0) holding another id would be read as the input's last token, and
    without a padding id it reads the last position, padding or not. Other models pass. A row
    whose attention mask is all zeros (nothing to read) is refused for every model, as the
    exported graph answers it with NaN: the two agree that it has no prediction."""
    for batch in batches:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if (
            isinstance(mask, torch.Tensor)
            and mask.dim() == 2
            and mask.shape[1]
            and not bool(mask.any(-1).all())
        ):
            row = int((~mask.any(-1)).nonzero()[0])
            raise error(f"row {row} of {what} has an attention mask of zeros only: there is nothing to read")
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
