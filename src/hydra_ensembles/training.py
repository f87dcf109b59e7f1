"""Fine-tuning pruned members (paper Appendix D.2), through Hugging Face Accelerate.

Each member is fine-tuned independently on the same training data: selectable trainable parts
(attention, MLP, LayerNorms, classifier head, embeddings; optionally only the last k blocks),
AdamW or SGD with momentum, linear warm-up then cosine (or linear) decay, label smoothing,
early stopping on validation NLL, reduced-precision autocast where the hardware has it
(`precision.resolve_precision`), a checkpoint per epoch and resume. The same
code runs on CPU, one GPU, or many processes under ``accelerate launch``.

Checkpoints hold safetensors and JSON only (optimizer state included), written atomically.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from .adapters import get_adapter, model_configs
from .adapters.base import is_under
from .batching import ExamplePool, checked_batches, member_stacked, model_inputs
from .errors import InputError
from .hashing import batches_digest, fingerprint, json_digest
from .io import MANIFEST, load_file_set, save_file_set
from .outputs import EnsembleOutput, ensemble_log_probs
from .precision import check_precision, resolve_precision
from .progress import progress_bar
from .serialization import check_finite, first_non_finite
from .surgery import forget_calibration

PARTS = ("attention", "mlp", "norm", "head", "embeddings")


FP16_INITIAL_SCALE = 2.0**10
"""fp16's first loss scale. PyTorch's default, 2^16, overflows the scaled gradients of a
transformer's first steps, so a short fine-tune skipped most of its steps (DINOv2-S: 2 of 3);
at 2^10 a gradient as small as 6e-8 is still a normal fp16 number once scaled."""
FP16_RETRIES = 8
"""Times an fp16 step whose scaled gradients overflow is taken again at half the scale before
it is counted as skipped."""


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
    trainable: Sequence[str] | None = ("attention", "mlp", "norm", "head")
    """Parts to train; ``None`` keeps the model's own ``requires_grad`` flags (e.g. LoRA adapters)."""
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


TRAINING_KEY = "hydra_training"
"""The configuration key (saved in ``config.json``) recording how a model was fine-tuned."""


def record_training(
    model: nn.Module, result: FineTuneResult, config: FineTuneConfig, train: Sequence[dict]
) -> None:
    """Record in ``model.config`` how it was fine-tuned: optimizer steps since the pretrained
    weights (``optimizer_steps``, this fine-tune's steps added to any the model already had, so a
    member pruned from a fine-tuned base counts the base's too, each stage in ``stages``), and the
    epochs, learning rate, precision and training examples (``train``'s) of the last stage.
    Reports compare methods by it (`training_summary`)."""
    before = dict(getattr(model.config, TRAINING_KEY, None) or {})
    stages = [int(n) for n in before.get("stages", [])] + [result.optimizer_steps]
    setattr(
        model.config,
        TRAINING_KEY,
        {
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
    records = [getattr(c, TRAINING_KEY, None) for c in model_configs(models)]
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


def _lr_factor(step: int, total: int, config: FineTuneConfig) -> float:
    warm = int(config.warmup * total)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if config.schedule == "cosine" else 1 - progress
    return config.min_lr_fraction + (1 - config.min_lr_fraction) * max(0.0, decay)


@torch.no_grad()
def evaluate_nll(model: nn.Module, batches: Iterable[dict[str, Any]], accelerator=None) -> dict[str, float]:
    """Mean NLL and accuracy of a classifier over labelled batches (gathered across processes)."""
    model.eval()
    losses, correct, count = 0.0, 0, 0
    for batch in batches:
        labels = batch["labels"]
        member_logits = _member_logits(model(**model_inputs(batch)), labels.shape[0])
        log_probs = ensemble_log_probs(member_logits)  # members at once: the ensemble's mean
        labels = labels.to(log_probs.device)
        if accelerator is not None:
            log_probs, labels = accelerator.gather_for_metrics((log_probs, labels))
        losses += F.nll_loss(log_probs, labels, reduction="sum").item()
        correct += (log_probs.argmax(-1) == labels).sum().item()
        count += len(labels)
    return {"nll": losses / count, "acc": correct / count}


def _member_logits(output: Any, batch: int) -> torch.Tensor:
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
        run = _Run.start(model, train_batches, val_batches, config, checkpoint_dir, progress)
        run.train(on_epoch)
    finally:
        model.to(device)
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
    model.eval()
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        record_training(model, run.result, config, train_batches)  # saved with its config
    return run.result


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
class _Run:
    """One fine-tuning run under Accelerate: its state between epochs and its checkpoint."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    accelerator: Any
    precision: Any
    scaler: Any
    config: FineTuneConfig
    train_batches: list[dict]
    val_batches: list[dict]
    per_step: int
    steps_per_epoch: int
    ckpt: Path | None
    inputs: str
    progress: bool
    result: FineTuneResult = field(default_factory=FineTuneResult)
    start_epoch: int = 0
    best_nll: float = math.inf
    best_state: dict[str, torch.Tensor] | None = None
    examples: ExamplePool | None = None
    """The training examples, dealt into new batches every epoch (``shuffle="examples"``)."""

    @classmethod
    def start(cls, model, train_batches, val_batches, config, checkpoint_dir, progress) -> _Run:
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
        scaler = None
        if precision.name == "fp16":
            scaler = torch.amp.GradScaler(accelerator.device.type, init_scale=FP16_INITIAL_SCALE)
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
        ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
        unwrapped = accelerator.unwrap_model(model)
        inputs = _inputs_digest(unwrapped, train_batches, val_batches) if ckpt else ""
        run = cls(model, optimizer, params, accelerator, precision, scaler, config, train_batches,
                  val_batches, per_step, steps_per_epoch, ckpt, inputs, progress)  # fmt: skip
        if config.shuffle == "examples":
            pad_id = int(getattr(getattr(unwrapped, "config", None), "pad_token_id", None) or 0)
            run.examples = ExamplePool(train_batches, pad_id)
        if ckpt is not None and has_checkpoint(ckpt):
            run.start_epoch, run.result, run.best_nll, run.best_state = _load_checkpoint(
                ckpt, unwrapped, optimizer, config, inputs, precision.name
            )
            if scaler is not None and run.result.history:  # the scale the last epoch ended with
                scale = float(run.result.history[-1].get("loss_scale", FP16_INITIAL_SCALE))
                run.scaler = torch.amp.GradScaler(accelerator.device.type, init_scale=scale)
        return run

    def train(self, on_epoch: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Every remaining epoch (with validation, early stopping and checkpoints), each record
        passed to ``on_epoch`` as the epoch ends."""
        config, total = self.config, self.config.epochs * self.steps_per_epoch
        bar = progress_bar(
            total=total * self.per_step,
            initial=self.start_epoch * self.steps_per_epoch * self.per_step,
            desc="fine-tune",
            enabled=self.progress and self.accelerator.is_main_process,
        )
        result = self.result
        waited = 0 if result.best_epoch is None else len(result.history) - 1 - result.best_epoch
        for epoch in range(self.start_epoch, config.epochs):
            record: dict[str, Any] = {"epoch": epoch, "steps": self.steps_per_epoch}
            record["train_loss"] = self._epoch(epoch, total, bar, record)
            if self.scaler is not None:
                record["loss_scale"] = self.scaler.get_scale()
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
            if self.ckpt is not None and self.accelerator.is_main_process:
                _save_checkpoint(self.ckpt, self.unwrapped, self.optimizer, config, epoch + 1, result,
                                 self.best_nll, self.best_state, self.inputs,
                                 self.precision.name)  # fmt: skip
            if config.patience is not None and waited >= config.patience:
                result.stopped_early = True
                break
        bar.close()
        if self.best_state is not None and config.patience is not None:
            self.unwrapped.load_state_dict(self.best_state)

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
                group["lr"] = config.lr * _lr_factor(
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
                    accelerator.backward(scaled if self.scaler is None else self.scaler.scale(scaled))
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
            output = self.model(**{k: v.to(device) for k, v in model_inputs(batch).items()})
        labels = batch["labels"].to(device)
        logits = _member_logits(output, labels.shape[0])
        # labels (B,): every member's; labels (B, M): member m's in column m (MIMO's mixed rows)
        targets = labels.T.reshape(-1) if labels.dim() == 2 else labels.repeat(logits.shape[0])
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets, label_smoothing=self.config.label_smoothing
        )

    def _step(self) -> bool:
        """The optimizer step; False where fp16's scaled gradients overflowed and it was skipped
        (the loss scale is then halved)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.config.grad_clip:
            self.accelerator.clip_grad_norm_(self.params, self.config.grad_clip)
        if self.scaler is None:
            self.optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def _validate(self, epoch: int, record: dict[str, Any]) -> bool:
        """Validation NLL/accuracy into ``record``; True (and the weights kept) if the best yet."""
        device = self.accelerator.device
        scores = evaluate_nll(self.model, [{k: v.to(device) for k, v in b.items()} for b in self.val_batches])
        record.update({"val_nll": scores["nll"], "val_acc": scores["acc"]})
        if scores["nll"] >= self.best_nll:
            return False
        self.best_nll, self.result.best_epoch = scores["nll"], epoch
        self.best_state = {k: v.detach().cpu().clone() for k, v in self.unwrapped.state_dict().items()}
        return True


def _optimizer_tensors(optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _inputs_digest(model: nn.Module, train: list[dict], val: list[dict]) -> str:
    """SHA-256 of everything besides the configuration that shapes a fine-tuning run: the starting
    weights and every train and validation batch. A checkpoint resumes only the same run."""
    return json_digest([fingerprint(model), batches_digest(train), batches_digest(val)])


def _save_checkpoint(
    ckpt: Path,
    model,
    optimizer,
    config,
    epochs_done,
    result,
    best_nll,
    best_state,
    inputs: str,
    precision: str,
) -> None:
    """The epoch's weights, optimizer state, best weights and state, saved as one set
    (`io.save_file_set`): a kill between two files resumes from the previous epoch, never from
    a mix of two."""
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tensors, meta = _optimizer_tensors(optimizer)
    files = {
        "model.safetensors": lambda tmp: save_file(weights, str(tmp)),
        "optimizer.safetensors": lambda tmp: save_file(tensors, str(tmp)),
    }
    if best_state is not None:
        files["best.safetensors"] = lambda tmp: save_file(best_state, str(tmp))
    state = {
        "epochs_done": epochs_done,
        "config": _config_json(config),
        "history": result.history,
        "best_epoch": result.best_epoch,
        "best_nll": best_nll if math.isfinite(best_nll) else None,
        "optimizer": meta,
        "inputs_sha256": inputs,
        "precision": precision,
    }
    save_file_set(ckpt, files, state)


def has_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds a saved epoch (or what an older version saved there)."""
    return (ckpt / MANIFEST).is_file() or (ckpt / "state.json").is_file()


class TrainingDiverged(InputError):
    """Fine-tuning produced a non-finite loss or weights (too high a learning rate, bad data)."""


class CheckpointError(InputError):
    """A fine-tuning checkpoint cannot resume this run (another run's, or damaged)."""


def _load_checkpoint(
    ckpt: Path, model, optimizer, config, inputs: str, precision: str
) -> tuple[int, FineTuneResult, float, dict[str, torch.Tensor] | None]:
    try:
        return _restore(ckpt, model, optimizer, config, inputs, precision)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:  # a damaged checkpoint
        raise CheckpointError(
            f"the fine-tuning checkpoint in {ckpt} cannot be read ({type(exc).__name__}: {exc}); "
            "delete it to start over"
        ) from exc


def _restore(
    ckpt: Path, model, optimizer, config, inputs: str, precision: str
) -> tuple[int, FineTuneResult, float, dict[str, torch.Tensor] | None]:
    saved_set = load_file_set(ckpt)
    if saved_set is None:
        raise CheckpointError(
            f"checkpoint in {ckpt} was saved by an older version of hydra-ensembles; delete it to start over"
        )
    state, files = saved_set
    if state["config"] != _config_json(config):  # every setting, the number of epochs included
        raise CheckpointError(
            f"checkpoint in {ckpt} was made with another configuration; delete it to start over"
        )
    if state.get("precision", precision) != precision:
        raise CheckpointError(
            f"checkpoint in {ckpt} was trained in {state['precision']}, this run computes in {precision}; "
            f"pass precision={state['precision']!r} to resume it, or delete it to start over"
        )
    if state.get("inputs_sha256") != inputs:
        raise CheckpointError(
            f"checkpoint in {ckpt} was made from other data or another starting model (or by an "
            "older release); delete it to start over"
        )
    model.load_state_dict(load_file(str(files["model.safetensors"])))
    tensors = load_file(str(files["optimizer.safetensors"]))
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    for key, value in state["optimizer"]["scalars"].items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state["optimizer"]["param_groups"]})
    result = FineTuneResult(history=state["history"], best_epoch=state["best_epoch"])
    best = state["best_nll"] if state["best_nll"] is not None else math.inf
    best_state = load_file(str(files["best.safetensors"])) if "best.safetensors" in files else None
    return int(state["epochs_done"]), result, best, best_state


def _config_json(config: FineTuneConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
