"""Per-example predictions with their uncertainty, and a flag for inputs to send elsewhere.

`per_example` turns an ensemble's predictions into one record per input: the predicted class,
its probability, the class probabilities, predictive entropy (total uncertainty) and, for an
ensemble, mutual information (the members' disagreement: epistemic uncertainty) and the share of
members that agree with the ensemble. `flag_threshold` picks, on labelled ID *validation* data, the OOD-score
value that keeps a chosen share of ID inputs unflagged; inputs above it are flagged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import metrics as M
from ..errors import InputError
from ..ood.detectors import FeatureStatistics
from ..ood.registry import feature_scores
from .conformal import flags, quantile_threshold
from .evaluate import member_feature_scores, ood_scores
from .predict import Predictions


def per_example(
    predictions: Predictions,
    classes: Sequence[str] | None = None,
    temperature: float | np.ndarray = 1.0,
    flag_score: str = "msp",
    threshold: float | None = None,
    statistics: FeatureStatistics | None = None,
) -> list[dict[str, Any]]:
    """One record per input (see the module docstring); ``classes`` names the columns of the
    probabilities (indices when None). ``ood_score_<flag_score>`` holds the input's OOD score
    (higher = more likely OOD; ``ood_score_msp`` is 1 - the largest class probability; a feature
    score, under ``statistics``, is the mean of the members' scores and, for an ensemble,
    ``ood_score_<flag_score>_spread`` their standard deviation); with ``threshold``, ``flagged``
    says whether it is not at or below the threshold (`conformal.flags`: NaN is flagged)."""
    member_probs = predictions.member_probs(temperature)
    probs = member_probs.mean(0)
    num_classes = probs.shape[1]
    names = list(classes) if classes else [str(c) for c in range(num_classes)]
    if len(names) != num_classes:
        raise InputError(f"{len(names)} class names for a model with {num_classes} classes")
    predicted = probs.argmax(-1)
    agreeing = (member_probs.argmax(-1) == predicted[None]).mean(0)
    entropy = M.entropy_score(probs)
    mutual = M.mutual_information_score(member_probs)
    ensemble = predictions.num_members > 1
    labels = None if predictions.labels is None else predictions.class_labels()
    spread = None
    if flag_score in feature_scores():
        members = member_feature_scores(predictions, flag_score, statistics)
        score, spread = members.mean(0), members.std(0) if ensemble else None
    else:
        score = ood_scores(predictions, flag_score, temperature)
    flagged = None if threshold is None else flags(score, threshold)
    records = []
    for i in range(probs.shape[0]):
        record: dict[str, Any] = {
            "predicted": names[predicted[i]],
            "confidence": float(probs[i, predicted[i]]),
            **{f"p_{name}": float(p) for name, p in zip(names, probs[i], strict=True)},
            "entropy": float(entropy[i]),
        }
        if ensemble:  # members' disagreement: a single model has none to report
            record.update(mutual_information=float(mutual[i]), members_agreeing=float(agreeing[i]))
        record[f"ood_score_{flag_score}"] = float(score[i])
        if spread is not None:
            record[f"ood_score_{flag_score}_spread"] = float(spread[i])
        if threshold is not None:
            record["flagged"] = bool(flagged[i])
        if labels is not None:
            record["label"] = names[int(labels[i])]
            record["correct"] = bool(predicted[i] == labels[i])
        records.append(record)
    return records


def flag_threshold(
    id_validation: Predictions,
    score: str = "msp",
    keep: float = 0.95,
    temperature: float | np.ndarray = 1.0,
    statistics: FeatureStatistics | None = None,
) -> float:
    """The ``score`` value at or below which a share ``keep`` of ID validation inputs fall (the
    usual 95%-TPR operating point when ``keep`` = 0.95). Never fit this on OOD test data."""
    if not 0 < keep <= 1:
        raise InputError(f"keep must be in (0, 1], got {keep}")
    return quantile_threshold(ood_scores(id_validation, score, temperature, statistics), keep)


def predict_records(
    model: Any,
    dataset: Any,
    batches: list[dict[str, Any]],
    calibration: Any = None,
    classes: Sequence[str] | None = None,
    *,
    precision: str = "auto",
    flag_score: str = "msp",
    progress: bool = True,
) -> tuple[Predictions, list[dict[str, Any]], float]:
    """What ``hydra-ens predict`` writes for ``dataset`` (its ``batches``, `data.model_batches`):
    the predictions, one record per input (its ``id``, its ``text`` for text data, then
    ``calibration``'s records, or `per_example`'s flagged on ``flag_score`` without one), and
    the seconds the forward passes took. Every engine that scores data (one process, Ray's
    workers) writes these records."""
    import time

    from .predict import predict

    layers = calibration is not None and calibration.flag.reads_layers
    started = time.perf_counter()
    preds = predict(model, batches, "predict", progress=progress, precision=precision, layers=layers)
    forward = time.perf_counter() - started
    if calibration is not None:
        records = calibration.records(preds, classes)
    else:
        records = per_example(preds, classes, flag_score=flag_score)
    texts = getattr(dataset, "texts", None)
    rows = [
        {"id": dataset.ids[i], **({"text": texts[i]} if texts else {}), **record}
        for i, record in enumerate(records)
    ]
    return preds, rows, forward
