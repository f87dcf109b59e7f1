"""Calibrating a model: its predictions on ID validation data (and its members' features on ID
training data) fit a `Calibration`, recorded in the model's metadata and saved
with it; `saved_calibration` reads it back from a loaded model, bound to the weights it was fit
on. Never fit a calibration on OOD test data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..evaluation.evaluate import ood_score_names
from ..evaluation.flag_score import validation_aurocs
from ..evaluation.predict import Predictions, predict
from ..members.ensemble import as_ensemble
from ..ood.detectors import FeatureStatistics
from ..ood.features import ensemble_heads
from ..ood.registry import feature_scores
from ..precision import model_device, resolve_precision
from ..saving.metadata import read_metadata, write_metadata
from ..surgery import fingerprint
from .calibration import Calibration
from .provenance import NO_DATA, DataRecord, Provenance
from .settings import AUTO_SCORE, CalibrationConfig


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


@dataclass(frozen=True)
class CalibrationFit:
    """What `fit_calibration` fit and measured: the calibration, the ID validation predictions it
    was fit on, and where OOD validation data was given, their predictions and every candidate
    score's AUROC of ID against OOD validation (`validation_aurocs`, at the fitted temperature)."""

    calibration: Calibration
    validation: Predictions
    ood_validation: Predictions | None = None
    aurocs: dict[str, float] = field(default_factory=dict)


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
    statistics: FeatureStatistics | None = None,
    statistics_data: DataRecord = NO_DATA,
    ood_validation: Iterable[dict[str, Any]] | None = None,
    ood_data: str = "",
    measure_ood: bool = True,
    **settings: Any,
) -> CalibrationFit:
    """Fit a `Calibration` of ``model`` (any model or ensemble `predict` takes, a list of models
    included) on labelled ID validation batches (named ``data``) with ``config`` (keyword
    ``settings`` replace single fields of it); nothing is recorded in the model (`calibrate`
    does, for one model). The feature scores read statistics fit here on labelled ID training
    batches ``id_train`` (named ``train_data``), or ``statistics`` fit earlier (a saved
    calibration's, or fit on Ray) with the record of the data they were fit on,
    ``statistics_data``. Unlabelled OOD validation batches ``ood_validation`` (named
    ``ood_data``) choose the flag score where ``score="auto"`` (`choose_flag_score`) and are
    measured against the ID validation data by every candidate score (with ``measure_ood=False``,
    they are read only to choose the flag score). The one fit path of the library and of the
    command line (build, finetune, calibrate, predict --val-data)."""
    config = CalibrationConfig.merged(config, settings)
    batches = list(id_validation)
    _check_fit_request(config, batches, id_train, statistics)
    compute = resolve_precision(precision, model_device(model))
    if id_train is not None:
        train = list(id_train)
        statistics = fit_statistics(model, train, precision=precision, progress=progress)
        statistics_data = DataRecord.of_batches(train_data, train)
    layers = statistics is not None and statistics.reads_layers  # what the scores read, recorded
    run = functools.partial(predict, model, progress=progress, precision=precision, layers=layers)
    predictions = run(batches, "calibration")
    read_ood = ood_validation is not None and (measure_ood or config.score == AUTO_SCORE)
    ood, ood_record = _predicted(run, ood_validation, ood_data) if read_ood else (None, NO_DATA)
    read = Provenance(DataRecord.of_batches(data, batches), statistics_data, ood_record)
    calibration = Calibration.fit(predictions, config, provenance=read, precision=compute.name,
                                  statistics=statistics, ood_validation=ood)  # fmt: skip
    measured = ood is not None and measure_ood
    aurocs = validation_aurocs(predictions, ood, statistics, calibration.temperature) if measured else {}
    return CalibrationFit(calibration, predictions, ood, aurocs)


def _predicted(run: Any, batches: Iterable[dict[str, Any]], name: str) -> tuple[Predictions, DataRecord]:
    """The OOD validation ``batches``' predictions (by ``run``) and their record, named ``name``."""
    batches = list(batches)
    return run(batches, "OOD validation"), DataRecord.of_batches(name, batches)


def _check_fit_request(
    config: CalibrationConfig, batches: list[dict[str, Any]], id_train: Any, statistics: Any
) -> None:
    """InputError, before any work, for what `fit_calibration` cannot fit."""
    if not batches or not all("labels" in batch for batch in batches):
        raise InputError("calibration needs labelled ID validation batches (every batch with labels)")
    if config.score not in (*ood_score_names(), AUTO_SCORE):
        choices = (AUTO_SCORE, *ood_score_names())
        raise InputError(f"unknown OOD score {config.score!r}; choose from {choices}")
    if id_train is not None and statistics is not None:
        raise InputError("give the ID training data or statistics fit earlier, not both")
    if config.score in feature_scores() and id_train is None and statistics is None:
        raise InputError(
            f"the flag score {config.score!r} reads feature statistics: give the ID training data"
        )


def calibrate(
    model: Any,
    id_validation: Iterable[dict[str, Any]],
    config: CalibrationConfig | None = None,
    **options: Any,
) -> Calibration:
    """Fit ``model``'s `Calibration` on labelled ID validation batches with ``config``
    (`fit_calibration`, which takes the same keyword options and settings; the OOD validation
    data only chooses the flag score here, unmeasured), bind it to the model's weights and record
    it in the model (saved with it from then on). ``model`` is a Hydra model, a member, an
    ensemble of members or a Hugging Face classifier."""
    fit = fit_calibration(model, id_validation, config, measure_ood=False, **options)
    return record_calibration(model, fit.calibration)


def record_calibration(model: Any, calibration: Calibration) -> Calibration:
    """Bind ``calibration`` to ``model``'s weights and record it (and its feature statistics) in
    the model: what its savers write and `saved_calibration` reads."""
    calibration = dataclasses.replace(calibration, model_sha256=fingerprint(model))
    write_metadata(model, calibration=calibration.to_dict(), statistics=calibration.flag.statistics)
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
            "was trained, pruned or cast since): fit it again (calibration.calibrate, or --val-data)"
        )
    statistics = metadata.statistics
    if not calibration.flag.statistics_sha256:
        return calibration
    if statistics is None:
        raise InputError("the model's calibration names feature statistics, but the model holds none")
    return calibration.with_statistics(statistics)
