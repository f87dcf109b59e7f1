"""Calibrating a model: its predictions on ID validation data (and its members' features on ID
training data) fit a `Calibration` (`calibration`), recorded in the model's metadata and saved
with it; `saved_calibration` reads it back from a loaded model, bound to the weights it was fit
on. Never fit a calibration on OOD test data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

from ..errors import InputError
from ..hashing import batches_digest
from ..members.ensemble import as_ensemble
from ..ood.detectors import FeatureStatistics
from ..ood.features import ensemble_heads
from ..ood.registry import feature_scores
from ..precision import model_device, resolve_precision
from ..saving.metadata import read_metadata, write_metadata
from ..surgery import fingerprint
from .calibration import (
    AUTO_SCORE,
    Calibration,
    CalibrationConfig,
)
from .evaluate import ood_score_names
from .predict import Predictions, predict


def fit_statistics(
    model: Any,
    id_train: Iterable[dict[str, Any]],
    *,
    precision: str = "auto",
    progress: bool = True,
    layers: bool = True,
) -> FeatureStatistics:
    """The feature statistics of ``model`` (any model or ensemble `predict` takes) fit on the
    members' features of labelled ID training batches (`ood.FeatureStatistics.fit`; ViM also
    reads each member's output layer; ``mds_layers`` every layer's token, which the fit holds in
    memory for every training input, M x N x L x width floats: ``layers=False`` leaves it out).
    ValueError for a model whose logits are not one affine map of one feature vector per member."""
    batches = list(id_train)
    if not batches or not all("labels" in batch for batch in batches):
        raise InputError("feature statistics need labelled ID training batches (every batch with labels)")
    train = predict(
        model, batches, "feature statistics", progress=progress, precision=precision, layers=layers
    )
    if train.member_features is None:
        raise InputError(
            f"{type(model).__name__}'s logits are not one affine map of one feature vector per member: "
            "it has no features for the feature scores"
        )
    heads = ensemble_heads(as_ensemble(model))
    return FeatureStatistics.fit(
        train.member_features,
        train.class_labels("ID training data"),
        train.num_classes,
        heads,
        layer_features=train.layer_features,
    )


def fit_calibration(
    model: Any,
    id_validation: Iterable[dict[str, Any]],
    config: CalibrationConfig | None = None,
    *,
    data: str = "",
    precision: str = "auto",
    progress: bool = True,
    id_train: Iterable[dict[str, Any]] | None = None,
    train_data: str = "",
    ood_validation: Iterable[dict[str, Any]] | None = None,
    statistics: FeatureStatistics | None = None,
    ood_data: str = "",
    **settings: Any,
) -> tuple[Calibration, Predictions]:
    """A `Calibration` of ``model`` (any model or ensemble `predict` takes, a list of models
    included) fit on labelled ID validation batches with ``config`` (keyword ``settings`` replace
    single fields of it), with the predictions it was fit on; nothing is recorded in the model
    (`calibrate` does, for one model). With labelled ID training batches ``id_train`` (named
    ``train_data``), the feature statistics are fit on them and the feature scores can flag;
    ``score="auto"`` chooses the flag score by `choose_flag_score`, from the unlabelled OOD
    validation batches ``ood_validation`` where given. Without ``id_train``, ``statistics`` fit
    earlier (a saved calibration's) serve the feature scores."""
    config = CalibrationConfig.merged(config, settings)
    score = config.score
    batches = list(id_validation)
    if not batches or not all("labels" in batch for batch in batches):
        raise InputError("calibration needs labelled ID validation batches (every batch with labels)")
    if score not in (*ood_score_names(), AUTO_SCORE):
        raise InputError(f"unknown OOD score {score!r}; choose from {(AUTO_SCORE, *ood_score_names())}")
    if score in feature_scores() and id_train is None and statistics is None:
        raise InputError(f"the flag score {score!r} reads feature statistics: give the ID training data")
    compute = resolve_precision(precision, model_device(model))
    train_sha256 = ""
    if id_train is not None:
        train = list(id_train)
        statistics = fit_statistics(model, train, precision=precision, progress=progress)
        train_sha256 = batches_digest(train)
    layers = statistics is not None and statistics.reads_layers  # what the scores read, recorded
    run = functools.partial(predict, model, progress=progress, precision=precision, layers=layers)
    predictions = run(batches, "calibration")
    ood, ood_sha256 = None, ""
    if ood_validation is not None and score == AUTO_SCORE:
        ood_batches = list(ood_validation)
        ood = run(ood_batches, "OOD validation")
        ood_sha256 = batches_digest(ood_batches)
    calibration = Calibration.fit(
        predictions,
        config,
        data=data,
        data_sha256=batches_digest(batches),
        precision=compute.name,
        statistics=statistics,
        statistics_data=train_data,
        statistics_data_sha256=train_sha256,
        ood_validation=ood,
        ood_data=ood_data,
        ood_data_sha256=ood_sha256,
    )
    return calibration, predictions


def calibrate(
    model: Any,
    id_validation: Iterable[dict[str, Any]],
    config: CalibrationConfig | None = None,
    *,
    data: str = "",
    precision: str = "auto",
    progress: bool = True,
    id_train: Iterable[dict[str, Any]] | None = None,
    train_data: str = "",
    ood_validation: Iterable[dict[str, Any]] | None = None,
    ood_data: str = "",
    **settings: Any,
) -> Calibration:
    """Fit ``model``'s `Calibration` on labelled ID validation batches with ``config`` (keyword
    ``settings`` replace single fields of it; `fit_calibration`, with the feature statistics
    where ``id_train`` is given), bind it to the model's weights and record it in the model
    (saved with it from then on). ``model`` is a Hydra model, a member, an ensemble of members or
    a Hugging Face classifier; ``data`` names the batches' source."""
    fitted, _ = fit_calibration(
        model,
        id_validation,
        config,
        data=data,
        precision=precision,
        progress=progress,
        id_train=id_train,
        train_data=train_data,
        ood_validation=ood_validation,
        ood_data=ood_data,
        **settings,
    )
    return record_calibration(model, fitted)


def record_calibration(model: Any, calibration: Calibration) -> Calibration:
    """Bind ``calibration`` to ``model``'s weights and record it (and its feature statistics) in
    the model: what its savers write and `saved_calibration` reads."""
    calibration = dataclasses.replace(calibration, model_sha256=fingerprint(model))
    write_metadata(model, calibration=calibration.to_dict(), statistics=calibration.statistics)
    return calibration


def saved_calibration(model: Any) -> Calibration | None:
    """The `Calibration` recorded in ``model`` (with its feature statistics), or None where it has
    none; ValueError where it was fit on other weights or its statistics are not the recorded ones."""
    metadata = read_metadata(model)
    saved = metadata.calibration
    if saved is None:
        return None
    calibration = Calibration.from_dict(saved)
    if calibration.model_sha256 != fingerprint(model):
        raise InputError(
            "the calibration recorded in the model's configuration was fit on other weights (the model "
            "was trained, pruned or cast since): fit it again (evaluation.calibrate, or --val-data)"
        )
    statistics = metadata.statistics
    if not calibration.statistics_sha256:
        return calibration
    if statistics is None:
        raise InputError("the model's calibration names feature statistics, but the model holds none")
    return dataclasses.replace(calibration, statistics=statistics)
