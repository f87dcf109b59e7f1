"""Evaluate predictions: calibration on ID, OOD detection per dataset (near/far/average),
diversity, and accuracy/Brier under shift."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from .. import metrics as M
from ..errors import InputError
from ..ood.detectors import FeatureStatistics, check_scores
from ..ood.registry import LogitView, feature_score, feature_scores, logit_score, logit_scores, reads_layers
from .predict import Predictions


def ood_score_names() -> tuple[str, ...]:
    """Every OOD score, read from the registry when asked (`ood.registry`): every registered
    logit score, then every registered feature score (which read statistics fit on ID training
    data), each in the order of registration: the built-in ones (`ood.scores`), then those of
    installed packages (the ``hydra_ensembles.scores`` entry points) and of the caller's own
    modules."""
    return (*logit_scores(), *feature_scores())


def check_flag_score(score: str, members: int, model: str = "this model") -> None:
    """InputError, before any work, where ``score`` cannot flag a model of ``members`` members: a
    score of the members' disagreement (registered ``ensemble_only``: mutual information,
    ``mds_disagreement``) for a single model. ``model`` names the model in the message."""
    registered = logit_score(score) if score in logit_scores() else None
    if score in feature_scores():
        registered = feature_score(score)
    if registered is not None and registered.ensemble_only and members < 2:
        raise InputError(
            f"the OOD score {score!r} measures the members' disagreement: {model} is a single model and "
            "has none; choose another --flag-score (or auto)"
        )


Kind = Literal["near", "far"]


def ood_scores(
    predictions: Predictions,
    score: str = "msp",
    temperature: float | np.ndarray = 1.0,
    statistics: FeatureStatistics | None = None,
) -> np.ndarray:
    """Per-sample OOD scores (higher = more OOD) of an ensemble's predictions; a feature score is
    the mean of the members' scores on their own features under ``statistics``."""
    if score in feature_scores():
        return member_feature_scores(predictions, score, statistics).mean(0)
    if score in logit_scores():
        view = LogitView(predictions.member_logits, predictions.member_probs(temperature))
        return logit_score(score).score(view)
    raise InputError(f"unknown OOD score {score!r}; choose from {ood_score_names()}")


def member_feature_scores(
    predictions: Predictions, score: str, statistics: FeatureStatistics | None
) -> np.ndarray:
    """Each member's feature ``score`` (M, N) on its own features (ViM also reads the members'
    logits at temperature 1); ValueError where the predictions have no features or no statistics
    were fit."""
    check_scores([score], statistics)
    if predictions.member_features is None:
        raise InputError(f"the OOD score {score!r} reads the members' features; these predictions have none")
    scores = statistics.member_scores(
        score, predictions.member_features, predictions.member_logits, predictions.layer_features
    )
    return scores.numpy()


def applicable_scores(
    predictions: Predictions, statistics: FeatureStatistics | None = None
) -> tuple[str, ...]:
    """The OOD scores these predictions can be scored with: every logit score (those of an
    ensemble's disagreement for ensembles only) and, with features and statistics, every feature
    score they compute."""
    ensemble = predictions.num_members > 1
    logit = tuple(s for s in logit_scores() if ensemble or not logit_score(s).ensemble_only)
    if statistics is None or predictions.member_features is None:
        return logit
    layers = predictions.layer_features is not None
    return logit + tuple(s for s in statistics.scores if layers or not reads_layers(s))


def evaluate_predictions(
    id_test: Predictions,
    ood: Mapping[str, tuple[Kind, Predictions]] | None = None,
    shift: Mapping[tuple[str, int], Predictions] | None = None,
    temperature: float | np.ndarray = 1.0,
    scores: tuple[str, ...] | None = None,
    statistics: FeatureStatistics | None = None,
) -> dict[str, Any]:
    """All metrics of one method.

    ``ood`` maps dataset name -> ("near" | "far", predictions); ``shift`` maps
    (corruption, severity) -> labelled predictions; ``statistics``: the method's feature
    statistics (fit on its ID training features), for the feature scores. For an ensemble, each
    OOD set also records every feature score's AUROC member by member (``member_auroc``: the
    members' spread). ``scores``: the OOD scores to measure (every registered one by default,
    `ood_score_names`). Intervals: `evaluation.intervals`.
    """
    scores = ood_score_names() if scores is None else tuple(scores)
    id_labels = id_test.class_labels("ID test predictions")
    _check_same_model(id_test, ood, shift)
    ensemble = id_test.num_members > 1  # diversity (mutual information, disagreement) needs members
    result: dict[str, Any] = {"classification": M.classification(id_test.probs(temperature), id_labels)}
    if ensemble:
        result["diversity"] = {"id": M.diversity(id_test.member_probs(temperature))}
    if ood:
        result["ood"] = _ood_sets(id_test, ood, temperature, scores, statistics)
        result["ood_summary"] = summarise_ood(result["ood"])
        if ensemble:
            for name, (_, preds) in ood.items():
                result["diversity"][name] = M.diversity(preds.member_probs(temperature))
    if shift:
        result["shift"] = {
            f"{name}@{severity}": {
                "corruption": name,
                "severity": severity,
                **{
                    k: v
                    for k, v in M.classification(p.probs(temperature), p.class_labels(name)).items()
                    if k in ("acc", "brier")
                },
            }
            for (name, severity), p in shift.items()
        }
    return result


def _check_same_model(id_test: Predictions, ood, shift) -> None:
    """InputError where OOD or shifted predictions are not of the ID test's model (other member or
    class counts)."""
    others = [("OOD set " + name, p) for name, (_, p) in (ood or {}).items()]
    others += [(f"shift {name}@{severity}", p) for (name, severity), p in (shift or {}).items()]
    for what, preds in others:
        if (preds.num_members, preds.num_classes) != (id_test.num_members, id_test.num_classes):
            raise InputError(
                f"{what}: predictions of {preds.num_members} members over {preds.num_classes} classes, "
                f"the ID test's of {id_test.num_members} over {id_test.num_classes}: not one model's"
            )


def _ood_sets(
    id_test: Predictions,
    ood: Mapping[str, tuple[Kind, Predictions]],
    temperature: float | np.ndarray,
    scores: tuple[str, ...],
    statistics: FeatureStatistics | None,
) -> dict[str, Any]:
    """Per OOD set: its kind, every usable score's metrics against the ID test and, for an
    ensemble, every feature score's AUROC member by member."""
    usable = set(applicable_scores(id_test, statistics))
    id_scores = {s: ood_scores(id_test, s, temperature, statistics) for s in scores if s in usable}
    ensemble = id_test.num_members > 1
    per_member = [s for s in id_scores if ensemble and s in feature_scores()]
    id_members = {s: member_feature_scores(id_test, s, statistics) for s in per_member}
    per_set: dict[str, Any] = {}
    for name, (kind, preds) in ood.items():
        if kind not in ("near", "far"):
            raise InputError(f"OOD set {name!r}: kind must be 'near' or 'far', got {kind!r}")
        per_set[name] = {"kind": kind, "scores": {}}
        for score, id_s in id_scores.items():
            per_set[name]["scores"][score] = M.ood(id_s, ood_scores(preds, score, temperature, statistics))
        for score, id_m in id_members.items():
            theirs = member_feature_scores(preds, score, statistics)
            per_set[name].setdefault("member_auroc", {})[score] = [
                M.auroc(id_m[m], theirs[m]) for m in range(len(id_m))
            ]
    return per_set


def main_row(result: Mapping[str, Any], score: str | None = None) -> dict[str, float]:
    """The paper's Table 1 row: ID calibration and the OOD average (near and far) for ``score``
    (None: the row's own ``flag_score``, else ``msp``). Every other score's OOD average is there
    too, as ``<metric>@<score>``."""
    score = score or result.get("flag_score", "msp")
    row = dict(result["classification"])
    summary = result.get("ood_summary", {})
    average = summary.get(score, {}).get("average", {})
    row.update({k: average[k] for k in ("auroc", "fpr95", "aupr_in", "aupr_out") if k in average})
    for other, groups in summary.items():
        average = groups.get("average", {})
        row.update(
            {f"{k}@{other}": average[k] for k in ("auroc", "fpr95", "aupr_in", "aupr_out") if k in average}
        )
    return row


def summarise_ood(per_set: Mapping[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean metrics over near-OOD sets, far-OOD sets, and their average (paper Tables 15-17)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    scores = next(iter(per_set.values()))["scores"].keys() if per_set else []
    for score in scores:
        groups = {}
        for kind in ("near", "far"):
            sets = [v["scores"][score] for v in per_set.values() if v["kind"] == kind]
            if sets:
                groups[kind] = {k: float(np.mean([s[k] for s in sets])) for k in sets[0]}
        if groups:
            groups["average"] = {
                k: float(np.mean([g[k] for g in groups.values()])) for k in next(iter(groups.values()))
            }
        out[score] = groups
    return out
