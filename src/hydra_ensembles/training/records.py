"""What a fine-tune did: its per-epoch history (`FineTuneResult`), and the record of it saved in a
model's configuration (optimizer steps since the pretrained weights) that reports compare."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..adapters import model_configs
from ..saving.metadata import read_metadata, write_metadata
from .config import FineTuneConfig


@dataclass
class FineTuneResult:
    history: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int | None = None
    stopped_early: bool = False

    @property
    def epochs_kept(self) -> int:
        """The epochs that made the weights returned (up to the best where early stopping
        restored it)."""
        return len(self.history) if self.best_epoch is None else self.best_epoch + 1

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken up to the weights returned, skipped fp16 steps not counted."""
        kept = self.history[: self.epochs_kept]
        return int(sum(r.get("steps", 0) - r.get("skipped_steps", 0) for r in kept))


def record_training(
    model: nn.Module, result: FineTuneResult, config: FineTuneConfig, train: Sequence[dict]
) -> None:
    """Record in ``model.config`` how it was fine-tuned: optimizer steps since the pretrained
    weights (``optimizer_steps``, this fine-tune's steps added to any the model already had, so a
    member pruned from a fine-tuned base counts the base's too, each stage in ``stages``), and the
    epochs, learning rate, precision and training examples (``train``'s) of the last stage.
    Reports compare methods by it (`training_summary`)."""
    before = dict(read_metadata(model).training or {})
    stages = [int(n) for n in before.get("stages", [])] + [result.optimizer_steps]
    write_metadata(
        model,
        training={
            "optimizer_steps": sum(stages),
            "stages": stages,
            "epochs": result.epochs_kept,
            "lr": config.lr,
            "precision": config.precision,
            "examples": sum(len(b["labels"]) for b in train if "labels" in b),
        },
    )


def describe_epoch(record: dict[str, Any]) -> str:
    """One line for a fine-tuning epoch's record: training loss, validation NLL and accuracy where
    measured, fp16 steps taken again or skipped."""
    line = f"epoch {record['epoch'] + 1}: train loss {record['train_loss']:.4f}"
    if "val_nll" in record:
        line += f", val NLL {record['val_nll']:.4f}, val accuracy {record['val_acc']:.4f}"
    if record.get("fp16_overflow_retries"):
        line += f", {record['fp16_overflow_retries']} fp16 steps taken again at a halved loss scale"
    if record.get("skipped_steps"):
        line += f", {record['skipped_steps']} steps SKIPPED (fp16 gradients overflowed)"
    return line


def training_records(models: Any) -> list[dict[str, Any]]:
    """The `record_training` records of a model, of an ensemble's members or of a list of models
    (those that have one)."""
    records = [read_metadata(c).training for c in model_configs(models)]
    records = [r for rec in records if isinstance(rec, dict) for r in rec.get("members", [rec])]
    return [r for r in records if isinstance(r, dict) and "optimizer_steps" in r]


def training_summary(models: Any) -> str | None:
    """``"<n> optimizer steps (<stage> + <stage>)"`` for a model or the members of an ensemble
    (per member, a range where they differ), or None where none records its training."""
    records = training_records(models)
    if not records:
        return None
    steps = sorted({int(r["optimizer_steps"]) for r in records})
    if len(steps) > 1:
        return f"{steps[0]}-{steps[-1]} optimizer steps per member"
    stages = records[0].get("stages") or []
    detail = f" ({' + '.join(str(int(n)) for n in stages)})" if len(stages) > 1 else ""
    return f"{steps[0]} optimizer steps{detail}"
