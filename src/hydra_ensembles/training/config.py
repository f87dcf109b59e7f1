"""What fine-tuning trains and how: `FineTuneConfig`, the parts a model trains, the epochs `auto`
gives and the learning-rate schedule."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..errors import InputError
from ..precision import check_precision

PARTS = ("attention", "mlp", "norm", "classifier", "embeddings")


@dataclass
class FineTuneConfig:
    """What to train and how. Defaults suit a small text model fine-tuned for a few epochs."""

    epochs: int = 3
    lr: float = 5e-5
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.9
    weight_decay: float = 0.01
    warmup: float = 0.1
    schedule: Literal["cosine", "linear"] = "cosine"
    min_lr_fraction: float = 0.0
    label_smoothing: float = 0.0
    trainable: Sequence[str] | None = ("attention", "mlp", "norm", "classifier")
    """Parts to train (`PARTS`; ``classifier`` is the task head: pooler and classification
    modules; ``head`` is its deprecated name); ``None`` keeps the model's own ``requires_grad``
    flags (e.g. LoRA adapters)."""
    last_k_blocks: int | None = None
    patience: int | None = None
    grad_clip: float | None = 1.0
    precision: str = "auto"
    """``auto`` (bf16 autocast only where the device computes it natively and faster, else fp32),
    or ``fp32``, ``bf16``, ``fp16`` (`precision.resolve_precision`)."""
    seed: int = 0
    shuffle: Literal["examples", "batches"] = "examples"
    """``examples``: every epoch deals the training examples into new batches, in a seeded random
    order (a class-sorted file would otherwise train on one-class batches); ``batches``: the
    given batches are kept and only their order is shuffled (data mixed beforehand, MIMO)."""
    batches_per_step: int | None = None
    """Batches per optimizer step (gradient of their mean loss), split across processes; default:
    one per process. Equal values give the same training with 1 or N processes."""

    def __post_init__(self) -> None:
        if self.trainable is not None and "head" in self.trainable:
            warnings.warn(
                "the trainable part 'head' is now called 'classifier'", DeprecationWarning, stacklevel=3
            )
            renamed = tuple("classifier" if part == "head" else part for part in self.trainable)
            object.__setattr__(self, "trainable", renamed)

    def validate(self) -> None:
        unknown = sorted(set(self.trainable or ()) - set(PARTS))
        if unknown:
            raise InputError(f"unknown trainable parts {unknown}; choose from {PARTS}")
        if self.epochs < 1 or self.lr <= 0:
            raise InputError("epochs must be >= 1 and lr > 0")
        if self.shuffle not in ("examples", "batches"):
            raise InputError(f"shuffle must be 'examples' or 'batches', got {self.shuffle!r}")
        if self.optimizer not in ("adamw", "sgd") or self.schedule not in ("cosine", "linear"):
            raise InputError("optimizer must be adamw|sgd and schedule cosine|linear")
        if not 0 <= self.warmup < 1 or not 0 <= self.label_smoothing < 1:
            raise InputError("warmup and label_smoothing must be in [0, 1)")
        check_precision(self.precision)


AUTO_EPOCHS_STEPS = 100
"""Optimizer steps `auto_epochs` gives small data at least."""
AUTO_EPOCHS_RANGE = (3, 20)


def auto_epochs(batches: int, batches_per_step: int = 1) -> int:
    """Epochs for a training set of ``batches`` batches: 3, or on small data as many as give at
    least 100 optimizer steps (at most 20): three epochs of 300 texts in batches of 32 (30 steps)
    left a MiniLM classifier far from converged (measurements in docs/cli.md)."""
    per_epoch = max(1, batches // max(1, batches_per_step))
    low, high = AUTO_EPOCHS_RANGE
    return min(high, max(low, math.ceil(AUTO_EPOCHS_STEPS / per_epoch)))


def trainable_parameters(model: nn.Module, config: FineTuneConfig) -> list[str]:
    """Names of the parameters ``config`` trains."""
    adapter = get_adapter(model)
    layers = adapter.num_layers(model)
    attention = tuple(p for layer in range(layers) for p in adapter.attention_paths(layer))
    first_block = 0 if config.last_k_blocks is None else max(0, layers - config.last_k_blocks)
    early = tuple(f"{adapter.layers_path}.{i}" for i in range(first_block))
    names = []
    for name, _ in model.named_parameters():
        path = name.rpartition(".")[0]
        if early and is_under(path, early):
            continue
        if config.last_k_blocks is not None and is_under(path, adapter.input_paths):
            continue
        part = "attention" if is_under(path, attention) else adapter.part_of(path, model.get_submodule(path))
        if part in config.trainable:
            names.append(name)
    return names


def lr_factor(step: int, total: int, config: FineTuneConfig) -> float:
    warm = int(config.warmup * total)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
    return config.min_lr_fraction + (1 - config.min_lr_fraction) * max(0.0, decay)
