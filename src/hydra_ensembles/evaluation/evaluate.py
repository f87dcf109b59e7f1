"""Evaluate predictions: calibration on ID, OOD detection per dataset (near/far/average),
diversity, and accuracy/Brier under shift."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from .. import metrics as M
from .predict import Predictions

OOD_SCORES = ("msp", "max_logit", "energy", "entropy", "mutual_information")
Kind = Literal["near", "far"]


def ood_scores(
    predictions: Predictions, score: str = "msp", temperature: float | np.ndarray = 1.0
) -> np.ndarray:
    """Per-sample OOD scores (higher = more OOD) of an ensemble's predictions."""
    if score == "msp":
        return M.msp_score(predictions.probs(temperature))
    if score == "entropy":
        return M.entropy_score(predictions.probs(temperature))
    if score == "mutual_information":
        if predictions.num_members < 2:
            raise ValueError("mutual information measures members' disagreement: it needs an ensemble")
        return M.mutual_information_score(predictions.member_probs(temperature))
    mean_logits = predictions.member_logits.mean(0)
    if score == "max_logit":
        return M.max_logit_score(mean_logits)
    if score == "energy":
        return M.energy_score(mean_logits)
    raise ValueError(f"unknown OOD score {score!r}; choose from {OOD_SCORES}")


def evaluate_predictions(
    id_test: Predictions,
    ood: Mapping[str, tuple[Kind, Predictions]] | None = None,
    shift: Mapping[tuple[str, int], Predictions] | None = None,
    temperature: float | np.ndarray = 1.0,
    scores: tuple[str, ...] = OOD_SCORES,
) -> dict[str, Any]:
    """All metrics of one method.

    ``ood`` maps dataset name -> ("near" | "far", predictions); ``shift`` maps
    (corruption, severity) -> labelled predictions. Intervals: `evaluation.bootstrap`.
    """
    id_labels = id_test.class_labels("ID test predictions")
    others = [("OOD set " + name, p) for name, (_, p) in (ood or {}).items()]
    others += [(f"shift {name}@{severity}", p) for (name, severity), p in (shift or {}).items()]
    for what, preds in others:
        if (preds.num_members, preds.num_classes) != (id_test.num_members, id_test.num_classes):
            raise ValueError(
                f"{what}: predictions of {preds.num_members} members over {preds.num_classes} classes, "
                f"the ID test's of {id_test.num_members} over {id_test.num_classes}: not one model's"
            )
    ensemble = id_test.num_members > 1  # diversity (mutual information, disagreement) needs members
    result: dict[str, Any] = {"classification": M.classification(id_test.probs(temperature), id_labels)}
    if ensemble:
        result["diversity"] = {"id": M.diversity(id_test.member_probs(temperature))}
    if ood:
        id_scores = {s: ood_scores(id_test, s, temperature) for s in scores if _applicable(s, id_test)}
        per_set: dict[str, Any] = {}
        for name, (kind, preds) in ood.items():
            if kind not in ("near", "far"):
                raise ValueError(f"OOD set {name!r}: kind must be 'near' or 'far', got {kind!r}")
            per_set[name] = {"kind": kind, "scores": {}}
            for score, id_s in id_scores.items():
                per_set[name]["scores"][score] = M.ood(id_s, ood_scores(preds, score, temperature))
            if ensemble:
                result["diversity"][name] = M.diversity(preds.member_probs(temperature))
        result["ood"] = per_set
        result["ood_summary"] = summarise_ood(per_set)
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


def _applicable(score: str, predictions: Predictions) -> bool:
    return score != "mutual_information" or predictions.num_members > 1


def main_row(result: Mapping[str, Any], score: str = "msp") -> dict[str, float]:
    """The paper's Table 1 row: ID calibration and the OOD average (near and far) for ``score``."""
    row = dict(result["classification"])
    average = result.get("ood_summary", {}).get(score, {}).get("average", {})
    row.update({k: average[k] for k in ("auroc", "fpr95", "aupr_in", "aupr_out") if k in average})
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
