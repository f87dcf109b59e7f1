"""Predictions of any classifier, explicit ensemble, or Hydra model as member logits (M, N, C)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..batching import batch_rows, member_stacked, model_inputs
from ..fusion import HydraModel
from ..precision import model_device, resolve_precision


@dataclass
class Predictions:
    """Member logits (M, N, C) (M = 1 for a single model) and labels (N,) if known."""

    member_logits: np.ndarray
    labels: np.ndarray | None = None

    @property
    def num_members(self) -> int:
        return self.member_logits.shape[0]

    def member_probs(self, temperature: float | np.ndarray = 1.0) -> np.ndarray:
        t = (
            np.asarray(temperature, dtype=np.float64).reshape(-1, 1, 1)
            if np.ndim(temperature)
            else temperature
        )
        x = self.member_logits / t
        x = x - x.max(-1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(-1, keepdims=True)

    def probs(self, temperature: float | np.ndarray = 1.0) -> np.ndarray:
        """Ensemble prediction: the mean of member softmaxes (never of logits)."""
        return self.member_probs(temperature).mean(0)


Predictor = nn.Module | Sequence[nn.Module]


@torch.no_grad()
def predict(
    model: Predictor,
    batches: Iterable[dict[str, Any]],
    desc: str = "predict",
    progress: bool = True,
    mc_samples: int = 0,
    precision: str = "auto",
) -> Predictions:
    """Run a model (or a list of models: an explicit ensemble) over batches.

    ``mc_samples > 0`` runs a single model that many times in train mode (MC dropout) and treats
    the samples as members. Forward passes run under ``precision``'s autocast
    (`precision.resolve_precision`: ``auto`` is bf16 only where the device computes it natively
    and faster); logits are returned in float32 either way.
    """
    models = list(model) if isinstance(model, Sequence) else [model]
    if not models:
        raise ValueError("predict needs a model or a non-empty list of models")
    device = model_device(models)
    with resolve_precision(precision, device).autocast(device):
        return _predict(models, batches, desc, progress, mc_samples)


def _predict(models: list[nn.Module], batches, desc: str, progress: bool, mc_samples: int) -> Predictions:
    parts: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    for batch in tqdm(list(batches), desc=desc, leave=False, disable=not progress or None):
        inputs = model_inputs(batch)
        if "labels" in batch:
            labels.append(batch["labels"].cpu().numpy())
        members = []
        for m in models:
            if isinstance(m, HydraModel):
                members.append(m.eval()(**inputs).member_logits.float())
            elif mc_samples:
                m.train()
                members += [m(**inputs).logits.float() for _ in range(mc_samples)]
                m.eval()
            else:  # (B, C), or (M*B, C) from a model answering for M members (a BatchEnsemble)
                members.append(member_stacked(m.eval()(**inputs).logits.float(), batch_rows(inputs)))
        parts.append(torch.cat([x if x.dim() == 3 else x.unsqueeze(0) for x in members]).cpu().numpy())
    logits = np.concatenate(parts, axis=1)
    return Predictions(logits, np.concatenate(labels) if labels else None)
