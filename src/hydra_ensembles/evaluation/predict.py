"""Predictions of any classifier, explicit ensemble, or Hydra model as member logits (M, N, C)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..batching import model_inputs, on_device
from ..errors import InputError
from ..inputs import check_padding, class_ids
from ..members.ensemble import as_ensemble
from ..precision import Precision, in_precision, model_device, resolve_precision
from ..progress import progress_bar


@dataclass
class Predictions:
    """Member logits (M, N, C) (M = 1 for a single model), labels (N,) if known, the features
    each member's output layer read (M, N, D) where the model has them (`ood.features`), and
    each member's pooled token after every layer (M, N, L, D_h) where they were recorded
    (`predict`'s ``layers``)."""

    member_logits: np.ndarray
    labels: np.ndarray | None = None
    member_features: np.ndarray | None = None
    layer_features: np.ndarray | None = None

    def __post_init__(self) -> None:
        logits = np.asarray(self.member_logits)
        if logits.ndim != 3 or 0 in logits.shape:
            raise InputError(
                f"member logits must be (members, inputs, classes), none empty; got {logits.shape}"
            )
        if logits.shape[2] < 2:
            raise InputError(
                f"a classifier needs at least two classes; this one gives {logits.shape[2]} logit per "
                "input, whose probability is always 1 (confidence 1, entropy 0, never flagged)"
            )
        for what, values, ndim, axes in (
            ("member features", self.member_features, 3, "(members, inputs, width)"),
            ("layer features", self.layer_features, 4, "(members, inputs, layers, width)"),
        ):
            shape = None if values is None else np.shape(values)
            if shape is not None and (len(shape) != ndim or shape[:2] != logits.shape[:2]):
                raise InputError(f"{what} must be {axes} for logits {logits.shape}; got {shape}")
        if self.labels is not None:
            labels = np.asarray(self.labels)
            if labels.shape != (logits.shape[1],):
                raise InputError(
                    f"{labels.shape[0] if labels.ndim else 0} labels for {logits.shape[1]} inputs"
                )
            if not np.issubdtype(labels.dtype, np.integer):
                raise InputError(f"labels must be integer class ids, got {labels.dtype}")

    def class_labels(self, what: str = "predictions") -> np.ndarray:
        """The labels, checked to be classes of these predictions (OOD data may carry labels of
        other classes, so this is checked where labels are used as classes); ValueError naming
        ``what`` where they are missing or out of range."""
        if self.labels is None:
            raise InputError(f"{what} need labels")
        return class_ids(self.labels, self.num_classes, what)

    @property
    def num_members(self) -> int:
        return self.member_logits.shape[0]

    @property
    def num_classes(self) -> int:
        return self.member_logits.shape[2]

    def member_probs(self, temperature: float | np.ndarray = 1.0) -> np.ndarray:
        t = np.asarray(temperature, dtype=np.float64)
        if not (np.isfinite(t).all() and (t > 0).all()):
            raise InputError(f"temperatures must be positive and finite, got {temperature}")
        if t.ndim:
            if t.size != self.num_members:
                raise InputError(f"{t.size} temperatures for {self.num_members} members")
            t = t.reshape(-1, 1, 1)
        x = self.member_logits / t
        x = x - x.max(-1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(-1, keepdims=True)

    def probs(self, temperature: float | np.ndarray = 1.0) -> np.ndarray:
        """Ensemble prediction: the mean of member softmaxes (never of logits)."""
        return self.member_probs(temperature).mean(0)


Predictor = nn.Module | Sequence[nn.Module]


def _upcast(model: nn.Module) -> nn.Module:
    """``model``, or an fp32 copy where any of its weights are bf16 or fp16."""
    low = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
    return in_precision(model, Precision("fp32", "requested")) if low else model


@torch.no_grad()
def predict(
    model: Predictor,
    batches: Iterable[dict[str, Any]],
    desc: str = "predict",
    progress: bool = True,
    mc_samples: int = 0,
    precision: str = "auto",
    layers: bool = False,
) -> Predictions:
    """Run any model or ensemble over batches (`members.as_ensemble`: a list of models is a deep
    ensemble, ``mc_samples > 0`` samples one model that many times with dropout on).

    Forward passes run under ``precision``'s autocast (`precision.resolve_precision`: ``auto`` is
    bf16 only where the device computes it natively). Logits are returned as float32 arrays; in
    bf16 or fp16 they carry that format's rounding (bf16: about 3 significant digits). fp32 on a
    model whose weights are bf16 or fp16 computes on an fp32 copy (autocast never upcasts).
    Batches are moved to the model's device (batches made on the CPU feed a GPU model).
    ``layers``: also record each member's pooled token after every layer (``layer_features``,
    which ``mds_layers`` reads) where the ensemble records them (a fused Hydra model, a deep
    ensemble, a single model).
    """
    batches = list(batches)
    if not batches:
        raise InputError(f"{desc}: no batches to predict")
    labelled = ["labels" in batch for batch in batches]
    if any(labelled) and not all(labelled):
        raise InputError(
            f"{desc}: {labelled.count(True)} batches have labels and {labelled.count(False)} do not: "
            "give labels for every batch or for none"
        )
    check_padding(batches, model, desc)
    device = model_device(list(model) if isinstance(model, Sequence) else [model])
    compute = resolve_precision(precision, device)
    if not compute.reduced:
        model = [_upcast(m) for m in model] if isinstance(model, Sequence) else _upcast(model)
    ensemble = as_ensemble(model, mc_samples).eval()
    parts: list[np.ndarray] = []
    features: list[np.ndarray] = []
    layer_parts: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    with compute.autocast(device), _recording_layers(ensemble, layers):
        for batch in progress_bar(batches, desc=desc, leave=False, enabled=progress):
            if "labels" in batch:
                labels.append(batch["labels"].cpu().numpy())
            output = ensemble(**on_device(model_inputs(batch), device))
            parts.append(output.member_logits.float().cpu().numpy())
            if output.member_features is not None:
                features.append(output.member_features.float().cpu().numpy())
            if output.layer_features is not None:
                layer_parts.append(output.layer_features.float().cpu().numpy())
    logits = np.concatenate(parts, axis=1)
    _check_finite_logits(logits, model, desc, compute.name)
    member_features = np.concatenate(features, axis=1) if len(features) == len(parts) else None
    layer_features = np.concatenate(layer_parts, axis=1) if len(layer_parts) == len(parts) else None
    return Predictions(logits, np.concatenate(labels) if labels else None, member_features, layer_features)


@contextlib.contextmanager
def _recording_layers(ensemble: nn.Module, on: bool) -> Iterator[None]:
    """Inside: ``ensemble`` records its members' every layer where ``on`` and it can (a fused
    model, a deep ensemble, a single model); its setting is restored on leaving."""
    was = getattr(ensemble, "record_layers", None)
    if on and was is not None:
        ensemble.record_layers = True
    try:
        yield
    finally:
        if was is not None:
            ensemble.record_layers = was


def _check_finite_logits(logits: np.ndarray, model: Predictor, desc: str, precision: str) -> None:
    """InputError naming the model and the cause where its logits overflowed (inf or NaN): weights
    too large for the forward pass in ``precision`` (a diverged or edited model), never a
    probability computed from them."""
    bad = ~np.isfinite(logits).all(axis=(0, 2))
    if not bad.any():
        return
    models = list(model) if isinstance(model, Sequence) else [model]
    largest = max(
        (float(p.detach().abs().max()) for m in models for p in m.parameters() if p.numel()), default=0.0
    )
    raise InputError(
        f"{desc}: {type(models[0]).__name__}'s logits are not finite on {int(bad.sum())} of {len(bad)} "
        f"inputs: its weights (largest magnitude {largest:.3g}) overflow the forward pass in {precision}; "
        "the model diverged or was edited: retrain it, or load the weights it was saved with"
    )
