"""Rows of a batch: its size, slices and member-stacked copies, and member-stacked logits (shared
by fusion, scoring, training and evaluation; the checks of batches are in `inputs`)."""

from __future__ import annotations

from typing import Any

import torch

from .errors import InputError


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch without its ``labels``."""
    return {k: v for k, v in batch.items() if k != "labels"}


def on_device(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The batch with its tensors on ``device`` (batches are made on the CPU; a model may be on a
    GPU); other values as they are."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class ExamplePool:
    """The examples of some batches, pooled once, to be dealt into new batches of the same sizes
    in any order (`deal`): a new mix of examples per batch, so a class-sorted file no longer trains
    on one-class batches. Sequences of different lengths are right-padded (``input_ids`` with
    ``pad_id``, other keys with 0); each dealt batch is trimmed to its longest attention mask.
    ValueError where a value is not one row per example."""

    def __init__(self, batches: list[dict[str, Any]], pad_id: int = 0) -> None:
        self.sizes = [batch_rows(b) for b in batches]
        keys = list(batches[0])
        if any(list(b) != keys for b in batches):
            raise InputError(
                "the batches hold different keys: they cannot be dealt anew (use shuffle='batches')"
            )
        self.tensors: dict[str, torch.Tensor] = {}
        for key in keys:
            parts = [b[key] for b in batches]
            if not all(
                isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n
                for t, n in zip(parts, self.sizes, strict=True)
            ):
                raise InputError(f"{key!r} is not one row per example: the batches cannot be dealt anew")
            if len({tuple(t.shape[1:]) for t in parts}) > 1:
                if any(t.dim() != 2 for t in parts):
                    raise InputError(f"{key!r} differs in shape between batches: they cannot be dealt anew")
                width = max(t.shape[1] for t in parts)
                value = pad_id if key == "input_ids" else 0
                parts = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in parts]
            self.tensors[key] = torch.cat(parts)

    def __len__(self) -> int:
        return sum(self.sizes)

    def deal(self, order: torch.Tensor) -> list[dict[str, Any]]:
        """The examples in ``order`` (a permutation of ``range(len(self))``) as batches of the
        pooled batches' sizes."""
        out, start = [], 0
        for n in self.sizes:
            rows = order[start : start + n]
            start += n
            batch = {k: v[rows] for k, v in self.tensors.items()}
            mask = batch.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.any()):
                width, used = mask.shape[1], int(mask.any(0).nonzero().max()) + 1
                batch = {
                    k: v[:, :used] if v.dim() >= 2 and v.shape[1] == width else v for k, v in batch.items()
                }
            out.append(batch)
        return out


def pad_id(model: Any) -> int:
    """The token id ``model`` pads with (its configuration's ``pad_token_id``; 0 where it has none,
    as an image model)."""
    return int(getattr(getattr(model, "config", None), "pad_token_id", None) or 0)


BOOTSTRAP_SALT = 7_919
"""Mixed into a bootstrap resample's seed, so that it draws apart from the training order of the
same seed."""


def bootstrap_batches(batches: list[dict[str, Any]], seed: int, pad_id: int = 0) -> list[dict[str, Any]]:
    """A bootstrap resample of the examples of ``batches``: as many examples, drawn with replacement
    (from ``seed``), dealt into batches of the same sizes (`ExamplePool`). Bagging: an ensemble's
    members trained on resamples drawn from different seeds see different data."""
    pool = ExamplePool(list(batches), pad_id)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + BOOTSTRAP_SALT)
    return pool.deal(torch.randint(len(pool), (len(pool),), generator=generator))


def batch_rows(inputs: dict[str, Any]) -> int:
    """dim 0 of the first tensor input (the batch size). Never converted with ``int``: under
    ``torch.export`` it stays symbolic, so an exported graph keeps a dynamic batch axis."""
    return next(v for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0).shape[0]


def slice_rows(inputs: dict[str, Any], start: int, stop: int, batch: int) -> dict[str, Any]:
    """Rows ``start:stop`` of every ``batch``-row tensor; other values as they are."""
    return {
        k: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch else v
        for k, v in inputs.items()
    }


def repeat_batch(value: Any, times: int, batch: int) -> Any:
    """``value`` repeated ``times`` along dim 0 if it is a tensor with ``batch`` rows, else as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.repeat(times, *([1] * (value.dim() - 1)))
    return value


def repeat_rows(inputs: dict[str, Any], times: int, batch: int | None = None) -> dict[str, Any]:
    """Every batch-shaped tensor repeated ``times`` along dim 0 (a member/candidate-stacked batch):
    rows ``r*B .. (r+1)*B - 1`` are copy r."""
    batch = batch_rows(inputs) if batch is None else batch
    return {k: repeat_batch(v, times, batch) for k, v in inputs.items()}


def repeat_call(args: tuple, kwargs: dict[str, Any], times: int, batch: int) -> tuple[tuple, dict[str, Any]]:
    """A call's positional and keyword arguments with every ``batch``-row tensor repeated
    ``times`` along dim 0 (for forward pre-hooks that fan a batch out to member rows)."""
    return tuple(repeat_batch(a, times, batch) for a in args), repeat_rows(kwargs, times, batch)


def first_copy_call(
    args: tuple, kwargs: dict[str, Any], times: int, batch: int
) -> tuple[tuple, dict[str, Any]]:
    """A call's arguments with every ``times * batch``-row tensor cut to its first ``batch`` rows
    (copy 0 of a member-stacked batch): the inverse of `repeat_call`."""
    rows = times * batch

    def first(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            return value[:batch]
        if isinstance(value, tuple):  # rotary embeddings come as (cos, sin)
            return tuple(first(v) for v in value)
        return value

    return tuple(first(a) for a in args), {k: first(v) for k, v in kwargs.items()}


def member_stacked(logits: torch.Tensor, batch: int) -> torch.Tensor:
    """Logits (k*B, C) of a model that answers for k members at once (a BatchEnsemble) as
    (k, B, C); ordinary logits (B, C) as (1, B, C)."""
    if logits.shape[0] % batch:
        raise InputError(f"{logits.shape[0]} rows of logits for a batch of {batch}")
    return logits.reshape(logits.shape[0] // batch, batch, *logits.shape[1:])


class StackMemberLogits:
    """Forward hook for a model whose head answers for M members side by side, (B, M*C) logits:
    rewrites them member-stacked, (M*B, C), the convention of `member_stacked`."""

    def __init__(self, num_members: int, labels: int) -> None:
        self.num_members, self.labels = num_members, labels

    def __call__(self, _module: Any, _args: tuple, output: Any) -> Any:
        logits = output.logits
        per_member = logits.reshape(logits.shape[0], self.num_members, self.labels).transpose(0, 1)
        output.logits = per_member.reshape(-1, self.labels)
        return output
