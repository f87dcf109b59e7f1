"""The training loop: `fine_tune` and the run it drives under Accelerate (epochs, optimizer steps,
fp16's loss scale, validation and early stopping, divergence checks, checkpoints)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ..batching import ExamplePool, member_stacked, model_inputs, on_device, pad_id
from ..errors import InputError
from ..inputs import checked_batches
from ..outputs import EnsembleOutput, ensemble_log_probs
from ..precision import Precision, resolve_precision
from ..progress import progress_bar
from ..saving.formats import check_finite, first_non_finite
from ..surgery import forget_calibration
from .checkpoint import CheckpointDir, TrainingState, inputs_digest
from .config import FineTuneConfig, lr_factor, trainable_parameters
from .loss_scale import FP16_RETRIES, LossScale
from .records import FineTuneResult, record_training


class TrainingDiverged(InputError):
    """Fine-tuning produced a non-finite loss or weights (too high a learning rate, bad data)."""


@torch.no_grad()
def evaluate_nll(model: nn.Module, batches: Iterable[dict[str, Any]], accelerator=None) -> dict[str, float]:
    """Mean NLL and accuracy of a classifier over labelled batches (gathered across processes)."""
    model.eval()
    losses, correct, count = 0.0, 0, 0
    for batch in batches:
        labels = batch["labels"]
        stacked = member_logits(model(**model_inputs(batch)), labels.shape[0])
        log_probs = ensemble_log_probs(stacked)  # members at once: the ensemble's mean
        labels = labels.to(log_probs.device)
        if accelerator is not None:
            log_probs, labels = accelerator.gather_for_metrics((log_probs, labels))
        losses += F.nll_loss(log_probs, labels, reduction="sum").item()
        correct += (log_probs.argmax(-1) == labels).sum().item()
        count += len(labels)
    return {"nll": losses / count, "acc": correct / count}


def member_logits(output: Any, batch: int) -> torch.Tensor:
    """(M, B, C) logits of a forward pass: an ensemble's members, a BatchEnsemble's stacked rows,
    or one model's logits as an ensemble of one (works through DDP-style wrappers too)."""
    if isinstance(output, EnsembleOutput):
        return output.member_logits
    return member_stacked(output.logits, batch)


def fine_tune(
    model: nn.Module,
    train: Iterable[dict[str, Any]],
    val: Iterable[dict[str, Any]] | None = None,
    config: FineTuneConfig | None = None,
    checkpoint_dir: str | Path | None = None,
    progress: bool = True,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> FineTuneResult:
    """Fine-tune ``model`` in place on labelled batches; returns the per-epoch history.
    ``on_epoch(record)`` is called as each epoch ends (`describe_epoch` words it).

    With ``val``, each epoch ends with validation NLL/accuracy; with ``patience`` too, training
    stops after that many epochs without a better NLL and the best weights are restored. With
    ``checkpoint_dir``, each epoch is saved and a rerun resumes after the last finished epoch.
    The parameters' ``requires_grad`` flags are the caller's again when it returns. Training runs
    where Accelerate finds an accelerator (a GPU, unless ``ACCELERATE_USE_CPU`` is set); the model
    is returned on the device it came on, as every other step expects. Weights stay
    in their dtype: fp16 weights are refused (train fp32 weights with ``precision="fp16"``).
    In fp16 each epoch's record has its final ``loss_scale`` and, where they happened,
    ``fp16_overflow_retries`` (steps taken again at a halved scale) and ``skipped_steps``.
    A Hugging Face model records how it was trained in its configuration (`record_training`).
    """
    config = config or FineTuneConfig()
    config.validate()
    if any(p.dtype == torch.float16 for p in model.parameters()):
        raise InputError(
            "fine_tune needs float32 weights (fp16 weights cannot be updated by a loss-scaled optimizer): "
            "load the model in float32 (torch_dtype=torch.float32, or model.float()) and pass "
            "FineTuneConfig(precision='fp16') to train in fp16 with float32 master weights"
        )
    check_finite(model.named_parameters(), "the model to fine-tune")
    train_batches, val_batches = _checked_batches(model, train, val, config)
    forget_calibration(model)  # fit for the weights before training
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    device = next(model.parameters()).device
    try:
        run = start_run(model, train_batches, val_batches, config, checkpoint_dir, progress)
        run.train(on_epoch)
    finally:
        model.to(device)
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
    model.eval()
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        record_training(model, run.state.result, config, train_batches)  # saved with its config
    return run.state.result


def _checked_batches(model: nn.Module, train, val, config: FineTuneConfig) -> tuple[list[dict], list[dict]]:
    """Train and validation batches as lists, each labelled within the model's classes."""
    num_labels = int(model.config.num_labels)
    train_batches = checked_batches(train, "train", num_labels, model=model)
    val_batches = list(val) if val is not None else []
    val_batches = checked_batches(val_batches, "val", num_labels, model=model) if val_batches else []
    if config.patience is not None and not val_batches:
        raise InputError("early stopping (patience) needs validation data")
    return train_batches, val_batches


def _optimizer(model: nn.Module, config: FineTuneConfig) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """The optimizer over the parameters ``config`` trains (flags set accordingly); no weight
    decay on biases and LayerNorm weights."""
    if config.trainable is None:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
    else:
        names = set(trainable_parameters(model, config))
        for name, param in model.named_parameters():
            param.requires_grad_(name in names)
    params = [p for n, p in model.named_parameters() if n in names]
    if not params:
        raise InputError(f"nothing to train: no parameters in parts {config.trainable}")
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr), params
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum), params


@dataclass
class Run:
    """One fine-tuning run under Accelerate: its state between epochs and its checkpoint."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    accelerator: Any
    precision: Precision
    loss_scale: LossScale | None
    """fp16's loss scale (None in other precisions)."""
    config: FineTuneConfig
    train_batches: list[dict]
    val_batches: list[dict]
    per_step: int
    steps_per_epoch: int
    checkpoint: CheckpointDir | None
    progress: bool
    state: TrainingState = field(default_factory=TrainingState)
    examples: ExamplePool | None = None
    """The training examples, dealt into new batches every epoch (``shuffle="examples"``)."""

    def train(self, on_epoch: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Every remaining epoch (with validation, early stopping and checkpoints), each record
        passed to ``on_epoch`` as the epoch ends."""
        config, total = self.config, self.config.epochs * self.steps_per_epoch
        bar = progress_bar(
            total=total * self.per_step,
            initial=self.state.epochs_done * self.steps_per_epoch * self.per_step,
            desc="fine-tune",
            enabled=self.progress and self.accelerator.is_main_process,
        )
        result = self.state.result
        waited = 0 if result.best_epoch is None else len(result.history) - 1 - result.best_epoch
        for epoch in range(self.state.epochs_done, config.epochs):
            record: dict[str, Any] = {"epoch": epoch, "steps": self.steps_per_epoch}
            record["train_loss"] = self._epoch(epoch, total, bar, record)
            if self.loss_scale is not None:
                record["loss_scale"] = self.loss_scale.value
            if self.val_batches:
                waited = 0 if self._validate(epoch, record) else waited + 1
            result.history.append(record)
            if on_epoch is not None and self.accelerator.is_main_process:
                with bar.external_write_mode(file=sys.stderr):  # the epoch's line apart from the bar
                    on_epoch(record)
            if (bad := first_non_finite(self.unwrapped.named_parameters())) is not None:
                raise TrainingDiverged(  # NaN/Inf weights predict NaN: never saved, never returned
                    f"fine-tuning diverged in epoch {epoch + 1}: the weights {bad} hold NaN or Inf; "
                    f"lower the learning rate (lr={config.lr:g})"
                )
            self._check_predicts(epoch)
            self.state.epochs_done = epoch + 1
            if self.checkpoint is not None and self.accelerator.is_main_process:
                self.checkpoint.save(self.state, self.unwrapped, self.optimizer, config)
            if config.patience is not None and waited >= config.patience:
                result.stopped_early = True
                break
        bar.close()
        if self.state.best_state is not None and config.patience is not None:
            self.unwrapped.load_state_dict(self.state.best_state)

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def _epoch(self, epoch: int, total: int, bar, record: dict[str, Any]) -> float:
        """One epoch of optimizer steps; returns the mean training loss. In fp16, a step whose
        scaled gradients overflow is taken again at the halved loss scale, up to
        ``FP16_RETRIES`` times; ``record`` says how many retries and skipped steps there were."""
        config, accelerator, per_step = self.config, self.accelerator, self.per_step
        torch.manual_seed(config.seed * 1000 + epoch)  # dropout and order depend on (seed, epoch) only
        examples = self.examples
        batches = self.train_batches if examples is None else examples.deal(torch.randperm(len(examples)))
        order = torch.randperm(len(batches)).tolist()
        self.model.train()
        running, seen = 0.0, 0
        for step_in_epoch in range(self.steps_per_epoch):
            for group in self.optimizer.param_groups:
                group["lr"] = config.lr * lr_factor(
                    epoch * self.steps_per_epoch + step_in_epoch, total, config
                )
            chunk = order[step_in_epoch * per_step : (step_in_epoch + 1) * per_step]
            mine = chunk[accelerator.process_index :: accelerator.num_processes]
            for attempt in range(FP16_RETRIES + 1):
                self.optimizer.zero_grad(set_to_none=True)
                losses = []
                for i in mine:  # gradient of the mean loss over the step's batches (all processes)
                    loss = self._loss(batches[i])
                    if not math.isfinite(value := loss.item()):
                        raise TrainingDiverged(
                            f"fine-tuning diverged at epoch {epoch + 1}, step {step_in_epoch + 1}: the loss "
                            f"is {value}; lower the learning rate (lr={config.lr:g}) or check the data"
                        )
                    scaled = loss / len(mine)
                    accelerator.backward(scaled if self.loss_scale is None else self.loss_scale.scale(scaled))
                    losses.append(value)
                if self._step():
                    break
                if attempt == FP16_RETRIES:
                    record["skipped_steps"] = record.get("skipped_steps", 0) + 1
                else:
                    record["fp16_overflow_retries"] = record.get("fp16_overflow_retries", 0) + 1
            running, seen = running + sum(losses), seen + len(losses)
            bar.update(per_step)
            bar.set_postfix(epoch=epoch, loss=f"{running / max(1, seen):.3f}")
        return running / max(1, seen)

    @torch.no_grad()
    def _check_predicts(self, epoch: int) -> None:
        """TrainingDiverged where the weights the epoch ends with, finite as they are, give NaN or
        Inf on the first training batch (weights so large that the forward pass overflows): such
        a model is never saved or returned."""
        was_training = self.model.training
        self.model.eval()
        try:
            loss = self._loss(self.train_batches[0])
        finally:
            self.model.train(was_training)
        if not bool(torch.isfinite(loss)):
            largest = max(float(p.detach().abs().max()) for p in self.params)
            raise TrainingDiverged(
                f"fine-tuning diverged in epoch {epoch + 1}: the trained model's loss on a training "
                f"batch is {float(loss)} (weights up to {largest:.3g}); lower the learning rate "
                f"(lr={self.config.lr:g})"
            )

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Cross-entropy of every member on the labels (one model: its own loss; a BatchEnsemble
        or fused model: the mean of its members' losses; a MIMO model: each member on its own
        column of (B, M) labels)."""
        device = self.accelerator.device
        with self.precision.autocast(device):
            output = self.model(**on_device(model_inputs(batch), device))
        labels = batch["labels"].to(device)
        logits = member_logits(output, labels.shape[0])
        # labels (B,): every member's; labels (B, M): member m's in column m (MIMO's mixed rows)
        targets = labels.T.reshape(-1) if labels.dim() == 2 else labels.repeat(logits.shape[0])
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets, label_smoothing=self.config.label_smoothing
        )

    def _step(self) -> bool:
        """The optimizer step; False where fp16's scaled gradients overflowed and it was skipped
        (the loss scale is then halved)."""
        if self.loss_scale is not None:
            self.loss_scale.unscale_(self.optimizer)
        if self.config.grad_clip:
            self.accelerator.clip_grad_norm_(self.params, self.config.grad_clip)
        if self.loss_scale is None:
            self.optimizer.step()
            return True
        return self.loss_scale.step(self.optimizer)

    def _validate(self, epoch: int, record: dict[str, Any]) -> bool:
        """Validation NLL/accuracy into ``record``; True (and the weights kept) if the best yet."""
        device = self.accelerator.device
        scores = evaluate_nll(self.model, [on_device(b, device) for b in self.val_batches])
        record.update({"val_nll": scores["nll"], "val_acc": scores["acc"]})
        state = self.state
        if scores["nll"] >= state.best_nll:
            return False
        state.best_nll, state.result.best_epoch = scores["nll"], epoch
        state.best_state = {k: v.detach().cpu().clone() for k, v in self.unwrapped.state_dict().items()}
        return True


def start_run(model, train_batches, val_batches, config, checkpoint_dir, progress) -> Run:
    """Prepare model and optimizer, and resume from ``checkpoint_dir`` where it holds a
    finished epoch of this very run."""
    from accelerate import Accelerator

    optimizer, params = _optimizer(model, config)
    # Autocast is applied per step rather than through Accelerate's process-wide
    # mixed-precision setting, so members with different settings can train in one process.
    accelerator = Accelerator()
    # prepare() places a model only the first time it sees it: one fine-tuned before (and
    # returned to the caller's device) is placed here
    model.to(accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    precision = resolve_precision(config.precision, accelerator.device)
    device_type = accelerator.device.type
    loss_scale = LossScale(device_type) if precision.name == "fp16" else None
    # A step consumes ``per_step`` batches, split across processes; a remainder that cannot
    # be split evenly is skipped for that epoch (every process must take part in a step).
    per_step = config.batches_per_step or accelerator.num_processes
    if per_step % accelerator.num_processes:
        raise InputError(
            f"batches_per_step={per_step} must be a multiple of the {accelerator.num_processes} processes"
        )
    steps_per_epoch = len(train_batches) // per_step
    if steps_per_epoch == 0:
        raise InputError(f"{len(train_batches)} training batches cannot fill one step of {per_step}")
    unwrapped = accelerator.unwrap_model(model)
    checkpoint = None
    if checkpoint_dir is not None:
        inputs = inputs_digest(unwrapped, train_batches, val_batches)
        checkpoint = CheckpointDir(Path(checkpoint_dir), inputs, precision.name)
    run = Run(
        model=model,
        optimizer=optimizer,
        params=params,
        accelerator=accelerator,
        precision=precision,
        loss_scale=loss_scale,
        config=config,
        train_batches=train_batches,
        val_batches=val_batches,
        per_step=per_step,
        steps_per_epoch=steps_per_epoch,
        checkpoint=checkpoint,
        progress=progress,
    )
    if config.shuffle == "examples":
        run.examples = ExamplePool(train_batches, pad_id(unwrapped))
    if checkpoint is not None and checkpoint.exists():
        run.state = checkpoint.load(unwrapped, optimizer, config)
        if loss_scale is not None:  # the scale the last finished epoch ended with
            run.loss_scale = LossScale.resumed(device_type, run.state.result.history)
    return run
