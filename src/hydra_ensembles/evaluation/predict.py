"""Predictions of any classifier, explicit ensemble, or Hydra model as member logits (M, N, C)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..batching import model_inputs
from ..members.ensemble import as_ensemble
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
    """Run any model or ensemble over batches (`members.as_ensemble`: a list of models is a deep
    ensemble, ``mc_samples > 0`` samples one model that many times with dropout on).

    Forward passes run under ``precision``'s autocast (`precision.resolve_precision`: ``auto`` is
    bf16 only where the device computes it natively and faster); logits are returned in float32.
    """
    ensemble = as_ensemble(model, mc_samples).eval()
    device = model_device(list(model) if isinstance(model, Sequence) else [model])
    parts: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    with resolve_precision(precision, device).autocast(device):
        for batch in tqdm(list(batches), desc=desc, leave=False, disable=not progress or None):
            if "labels" in batch:
                labels.append(batch["labels"].cpu().numpy())
            parts.append(ensemble(**model_inputs(batch)).member_logits.float().cpu().numpy())
    logits = np.concatenate(parts, axis=1)
    return Predictions(logits, np.concatenate(labels) if labels else None)
