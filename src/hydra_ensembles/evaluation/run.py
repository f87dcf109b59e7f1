"""The one evaluation path of a method (used by ``hydra-ens demo``, ``eval`` and ``predict``):
predict the ID test, validation, OOD and shifted sets, evaluate, and add temperature-scaled rows
fit on ID validation only. With ID training data, the method's feature statistics are fit on its
members' training features and every feature score is evaluated too; each row then names its
flag score (`flag_score.choose_flag_score`, on ID validation and the OOD validation set)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..members.ensemble import as_ensemble
from ..ood.detectors import FeatureStatistics
from ..ood.features import ensemble_heads
from .conformal import (
    conformal_threshold,
    fit_set_quantiles,
    flags,
    one_draw_range,
    prediction_sets,
    smallest_alpha,
)
from .evaluate import applicable_scores, evaluate_predictions, ood_scores
from .flag_score import DEFAULT_FEATURE_SCORE, choose_flag_score, validation_aurocs
from .intervals import add_intervals, bootstrap_draws
from .predict import Predictions
from .temperature import fit_temperature, split_for_sets

Batches = list[dict[str, Any]]
PredictFn = Callable[[Any, Batches, str], Predictions]
"""(model, batches, split name) -> predictions: `predict` with its options bound (or a cache)."""


@dataclass
class EvalData:
    """What a method is evaluated on, as batches: labelled ID test (and validation, for
    temperature scaling and the flag score's choice), OOD sets as name -> (near|far, batches),
    shifted ID test sets as (corruption, severity) -> batches, labelled ID training data (for the
    feature statistics) and OOD validation data (for the flag score's choice; never a test set)."""

    test: Batches
    ood: Mapping[str, tuple[str, Batches]] = field(default_factory=dict)
    shift: Mapping[tuple[str, int], Batches] = field(default_factory=dict)
    val: Batches | None = None
    train: Batches | None = None
    ood_val: Batches | None = None


@dataclass
class MethodPredictions:
    """A method's predictions on every set of an `EvalData`, and its members' output layers
    (``heads``: `ood.features.member_heads`, for ViM)."""

    test: Predictions
    ood: dict[str, tuple[str, Predictions]]
    shift: dict[tuple[str, int], Predictions]
    val: Predictions | None = None
    train: Predictions | None = None
    ood_val: Predictions | None = None
    heads: tuple[Any, Any] | None = None
    scaled: bool = True
    """Whether the method gets temperature-scaled rows (fit on ``val``)."""


def predict_method(
    model: Any, data: EvalData, predict: PredictFn, calibrate: bool = False
) -> MethodPredictions:
    """Predictions of ``model`` on ``data`` (validation where it will be ``calibrate``d or the
    OOD validation data choose its flag score; training data only for a model with features).
    The order (test, validation, OOD, shift, training, OOD validation) fixes the random masks of
    MC dropout."""
    test = predict(model, data.test, "test")
    val = predict(model, data.val, "val") if (calibrate or data.ood_val) and data.val else None
    ood = {name: (kind, predict(model, batches, name)) for name, (kind, batches) in data.ood.items()}
    shift = {key: predict(model, batches, f"{key[0]}@{key[1]}") for key, batches in data.shift.items()}
    train = ood_val = heads = None
    if test.member_features is not None and data.train:
        train = predict(model, data.train, "train")
        heads = ensemble_heads(as_ensemble(model))
        if heads is not None and heads[0].shape[0] != test.num_members:  # MC dropout: one model's head
            heads = tuple(h.expand(test.num_members, *h.shape[1:]) for h in heads)
    if data.ood_val:
        ood_val = predict(model, data.ood_val, "OOD validation")
    return MethodPredictions(test, ood, shift, val, train, ood_val, heads, scaled=calibrate)


SET_LEVELS = (0.1, 0.05)
"""The levels at which the evaluation measures conformal prediction sets."""


def conformal_set_metrics(
    val: Predictions, test: Predictions, scaled: bool = False
) -> dict[str, dict[str, dict[str, float]]]:
    """Split-conformal prediction sets fit on ``val`` and measured on the labelled ``test``:
    coverage and mean size per method (LAC, APS) and level. The ensemble probabilities are at
    temperature 1 (fit on nothing), or with ``scaled`` at a temperature fit on the even-numbered
    validation inputs, the sets then fit on the odd-numbered ones (`split_for_sets`: what a saved
    calibration with sets does, so the guarantee holds)."""
    temperature, fit_on = 1.0, val
    if scaled:
        temperature_on, fit_on = split_for_sets(val)
        temperature = float(fit_temperature(temperature_on))
    labels, fit_labels = (
        test.class_labels("ID test predictions"),
        fit_on.class_labels("validation predictions"),
    )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for alpha in SET_LEVELS:
        for method in ("lac", "aps"):
            quantiles = fit_set_quantiles(fit_on.probs(temperature), fit_labels, alpha, method)
            members = prediction_sets(test.probs(temperature), quantiles, method)
            out.setdefault(str(alpha), {})[method] = set_summary(members, labels)
    return out


def set_summary(members: np.ndarray, labels: np.ndarray, per_class: bool = False) -> dict[str, Any]:
    """Prediction sets ((N, C) booleans) on labelled inputs: their coverage and mean size, and
    with ``per_class`` each class's coverage (None for a class without inputs)."""
    covered = members[np.arange(len(labels)), labels]
    summary: dict[str, Any] = {"coverage": float(covered.mean()), "mean_size": float(members.sum(1).mean())}
    if per_class:
        summary["class_coverage"] = [
            float(covered[labels == c].mean()) if (labels == c).any() else None
            for c in range(members.shape[1])
        ]
    return summary


FLAG_LEVEL = 0.05
"""The level of the conformal flag whose ID test false-flag rate every evaluated row reports."""


def id_false_flag_rate(
    val: Predictions, test: Predictions, score: str, temperature: Any, statistics: Any
) -> dict[str, float]:
    """The conformal flag on ``score`` fit on the ID validation inputs at level `FLAG_LEVEL` (as
    ``calibrate`` fits it), and the share of ID test inputs it flags: at most the level in
    expectation, up to the ID test's sampling error (and the small reuse of the validation data
    that also chose the score)."""
    threshold = conformal_threshold(ood_scores(val, score, temperature, statistics), FLAG_LEVEL)
    rate = float(np.mean(flags(ood_scores(test, score, temperature, statistics), threshold)))
    return {"alpha": FLAG_LEVEL, "id_test_rate": rate, "id_test_inputs": int(test.member_logits.shape[1])}


def method_statistics(preds: MethodPredictions) -> FeatureStatistics | None:
    """The method's feature statistics, fit on its members' ID training features (None without),
    and on their every layer's pooled token where they were recorded (``mds_layers``)."""
    train = preds.train
    if train is None or train.member_features is None:
        return None
    labels = train.class_labels("ID training predictions")
    return FeatureStatistics.fit(
        train.member_features, labels, train.num_classes, preds.heads, layer_features=train.layer_features
    )


def _as_served(preds: MethodPredictions, served: Any, temperature, stats) -> dict[str, Any]:
    """What a saved calibration serves on the test sets: the share each set's inputs its flag
    raises (``flagged``) and, with prediction sets, their coverage and size on the ID test."""
    flagged = {"ID test": preds.test, **{k: p for k, (_, p) in preds.ood.items()}}
    flag, sets = served.flag, served.sets
    out: dict[str, Any] = {
        "flagged": {
            k: float(np.mean(flags(ood_scores(p, flag.score, temperature, stats), flag.threshold)))
            for k, p in flagged.items()
        }
    }
    if sets is not None:
        members, labels = served.prediction_sets(preds.test), preds.test.class_labels("ID test predictions")
        out["sets"] = {
            "method": sets.method,
            "alpha": sets.alpha,
            "one_draw_floor": 1 - one_draw_range(sets.examples, sets.alpha)[1],
            **set_summary(members, labels, per_class=True),
        }
    return out


def _flag_score_by_rule(preds: MethodPredictions, statistics, scores, temperature, row: dict) -> str:
    """The flag score `choose_flag_score` picks on the validation (and OOD validation) predictions,
    recording in ``row`` the validation AUROCs it chose by; without validation data, the rule's
    default (``mds`` where the statistics allow, else ``msp``)."""
    if preds.val is None:
        return DEFAULT_FEATURE_SCORE if DEFAULT_FEATURE_SCORE in scores else "msp"
    chosen = choose_flag_score(preds.val, statistics, preds.ood_val, temperature)
    if preds.ood_val is not None:  # what it was chosen by (validation sets only)
        row["flag_score_validation_auroc"] = validation_aurocs(
            preds.val, preds.ood_val, statistics, temperature
        )
    return chosen


def evaluate_method(
    name: str, preds: MethodPredictions, bootstrap: int = 0, seed: int = 0, saved: Any = None
) -> tuple[dict[str, Any], dict[str, float | list[float]], dict[str, dict[str, np.ndarray]]]:
    """Result rows of a method: ``name``, and where it is ``scaled`` with validation predictions,
    ``name + TS`` (one temperature) and, for ensembles, ``name + TS per member`` (each member's own
    temperature, fit on its own NLL). Every OOD score the predictions allow is evaluated (the
    feature scores under `method_statistics`), and each row names its ``flag_score``: the one
    `choose_flag_score` picks on its validation (and OOD validation) predictions, else ``msp``.
    With ``saved`` (the model's saved `Calibration`), the row ``name (as saved)`` measures what is
    served: the saved temperature and flag, with the share of each set it raises (``flagged``).
    Returns the rows, the fitted temperatures, and with ``bootstrap`` resamples each row's metric
    draws for every score (`evaluation.intervals`; the rows then hold their 95% ``intervals``)."""
    rows, temperatures, draws = {}, {}, {}
    statistics = method_statistics(preds)
    scores = applicable_scores(preds.test, statistics)

    def add(row_name: str, temperature: float | np.ndarray = 1.0, served: Any = None) -> None:
        own = served.flag.statistics if served is not None else None  # the saved calibration's
        stats = own if own is not None else statistics
        row = evaluate_predictions(preds.test, preds.ood, preds.shift, temperature, statistics=stats)
        if served is not None:  # what the saved calibration flags, as served
            chosen = served.flag.score
            row.update(_as_served(preds, served, temperature, stats))
        else:
            chosen = _flag_score_by_rule(preds, statistics, scores, temperature, row)
        row["flag_score"] = chosen
        if served is None and preds.val is not None and smallest_alpha(len(preds.val.labels)) <= FLAG_LEVEL:
            row["flag_rate"] = id_false_flag_rate(preds.val, preds.test, chosen, temperature, stats)
        rows[row_name] = row
        if bootstrap:
            usable = applicable_scores(preds.test, stats)
            draws[row_name] = bootstrap_draws(
                preds.test, preds.ood, temperature, bootstrap, seed, chosen, usable, stats
            )

    add(name)
    if preds.val is not None:  # conformal sets at temperature 1, calibrated on the validation data
        rows[name]["conformal_sets"] = conformal_set_metrics(preds.val, preds.test)
    if saved is not None:
        add(f"{name} (as saved)", saved.temperature, served=saved)
    if preds.val is not None and preds.scaled:
        shared = float(fit_temperature(preds.val))
        temperatures[f"{name} + TS"] = shared
        add(f"{name} + TS", shared)
        rows[f"{name} + TS"]["conformal_sets"] = conformal_set_metrics(preds.val, preds.test, scaled=True)
        if preds.val.num_members > 1:
            per_member = fit_temperature(preds.val, per_member=True)
            temperatures[f"{name} + TS per member"] = per_member.tolist()
            add(f"{name} + TS per member", per_member)
    add_intervals(rows, draws)
    return rows, temperatures, draws
