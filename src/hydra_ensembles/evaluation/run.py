"""The one evaluation path of a method (used by ``hydra-ens demo``, ``eval`` and ``predict``):
predict the ID test, validation, OOD and shifted sets, evaluate, and add temperature-scaled rows
fit on ID validation only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .bootstrap import add_intervals, bootstrap_draws
from .evaluate import evaluate_predictions
from .predict import Predictions
from .temperature import fit_temperature

Batches = list[dict[str, Any]]
PredictFn = Callable[[Any, Batches, str], Predictions]
"""(model, batches, split name) -> predictions: `predict` with its options bound (or a cache)."""


@dataclass
class EvalData:
    """What a method is evaluated on, as batches: labelled ID test (and validation, for
    temperature scaling), OOD sets as name -> (near|far, batches), shifted ID test sets as
    (corruption, severity) -> batches."""

    test: Batches
    ood: Mapping[str, tuple[str, Batches]] = field(default_factory=dict)
    shift: Mapping[tuple[str, int], Batches] = field(default_factory=dict)
    val: Batches | None = None


@dataclass
class MethodPredictions:
    """A method's predictions on every set of an `EvalData`."""

    test: Predictions
    ood: dict[str, tuple[str, Predictions]]
    shift: dict[tuple[str, int], Predictions]
    val: Predictions | None = None


def predict_method(
    model: Any, data: EvalData, predict: PredictFn, calibrate: bool = False
) -> MethodPredictions:
    """Predictions of ``model`` on ``data`` (validation only where it will be ``calibrate``d).
    The order (test, validation, OOD, shift) fixes the random masks of MC dropout."""
    test = predict(model, data.test, "test")
    val = predict(model, data.val, "val") if calibrate and data.val else None
    ood = {name: (kind, predict(model, batches, name)) for name, (kind, batches) in data.ood.items()}
    shift = {key: predict(model, batches, f"{key[0]}@{key[1]}") for key, batches in data.shift.items()}
    return MethodPredictions(test, ood, shift, val)


def evaluate_method(
    name: str, preds: MethodPredictions, bootstrap: int = 0, seed: int = 0
) -> tuple[dict[str, Any], dict[str, float | list[float]], dict[str, dict[str, np.ndarray]]]:
    """Result rows of a method: ``name``, and where validation predictions exist, ``name + TS``
    (one temperature) and, for ensembles, ``name + TS per member`` (each member's own
    temperature, fit on its own NLL). Returns the rows, the fitted temperatures, and with
    ``bootstrap`` resamples each row's metric draws (`evaluation.bootstrap`; the rows then hold
    their 95% ``intervals``)."""
    rows, temperatures, draws = {}, {}, {}

    def add(row_name: str, temperature: float | np.ndarray = 1.0) -> None:
        rows[row_name] = evaluate_predictions(preds.test, preds.ood, preds.shift, temperature)
        if bootstrap:
            draws[row_name] = bootstrap_draws(preds.test, preds.ood, temperature, bootstrap, seed)

    add(name)
    if preds.val is not None:
        shared = float(fit_temperature(preds.val))
        temperatures[f"{name} + TS"] = shared
        add(f"{name} + TS", shared)
        if preds.val.num_members > 1:
            per_member = fit_temperature(preds.val, per_member=True)
            temperatures[f"{name} + TS per member"] = per_member.tolist()
            add(f"{name} + TS per member", per_member)
    add_intervals(rows, draws)
    return rows, temperatures, draws
