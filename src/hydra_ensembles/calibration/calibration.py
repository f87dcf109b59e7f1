"""A model's calibration, fit once on labelled ID validation data and saved with the model.

A `Calibration` is its parts, each fit and saved on its own: the temperature (one, shared by the
members), the OOD flag (`parts.Flag`: the score that decides it, higher = more likely OOD, the
feature statistics a feature score reads, and the threshold that leaves a share ``keep`` of the
ID validation inputs unflagged), the conformal prediction sets where asked for
(`parts.PredictionSets`), and what each part was fit on (`provenance.Provenance`: the ID
validation data, the training data of the feature statistics, the OOD validation data that chose
the flag score, each a name and the SHA-256 of what was read), with the number of validation
inputs, the precision the predictions were computed in and the SHA-256 of the model's weights
(`surgery.fingerprint`): a calibration is refused for any other weights.

`fit.calibrate` fits it on a model and records it in the model's metadata (`saving.metadata`;
pruning, fusing and fine-tuning a model leave the new model without it), which `save_pretrained`
of a Hugging Face model, `save_member` and `HydraModel.save_pretrained` write with the
configuration (and so cover by their checksums); `fit.saved_calibration` reads it back from a
loaded model. `hydra-ens predict` and `Calibration.records` then give calibrated, flagged records
with no validation data at hand. Never fit a calibration on OOD test data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.labels import model_class_names, num_model_labels
from ..errors import InputError
from ..evaluation.evaluate import ood_scores
from ..evaluation.flag_score import choose_flag_score
from ..evaluation.predict import Predictions
from ..evaluation.temperature import (
    check_finite_logits,
    check_temperature_data,
    fit_temperature,
    split_for_sets,
)
from ..evaluation.uncertainty import per_example
from ..hashing import json_digest
from ..ood.detectors import FeatureStatistics
from .parts import Flag, PredictionSets
from .provenance import NO_DATA, NOTHING_READ, DataRecord, Provenance
from .settings import AUTO_SCORE, CalibrationConfig

RECORD_DIGEST = "record_sha256"
"""The key of a saved calibration record's own SHA-256."""


@dataclass(frozen=True)
class Calibration:
    """A model's temperature, OOD flag and prediction sets, and the data each was fit on."""

    temperature: float
    flag: Flag
    sets: PredictionSets | None
    provenance: Provenance
    examples: int
    precision: str
    model_sha256: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(f"calibration temperature must be positive and finite, got {self.temperature}")
        if not isinstance(self.flag, Flag) or not isinstance(self.provenance, Provenance):
            raise InputError("a calibration's flag is a Flag and its provenance a Provenance")
        if self.sets is not None and not isinstance(self.sets, PredictionSets):
            raise InputError("a calibration's prediction sets are PredictionSets, or None")
        if self.examples < 1:
            raise InputError(f"a calibration is fit on at least one input, got {self.examples}")

    @classmethod
    def fit(
        cls,
        id_validation: Predictions,
        config: CalibrationConfig | None = None,
        *,
        provenance: Provenance = NOTHING_READ,
        precision: str = "",
        model_sha256: str = "",
        statistics: FeatureStatistics | None = None,
        ood_validation: Predictions | None = None,
        id_scores: Any = None,
        **settings: Any,
    ) -> Calibration:
        """Fit on labelled ID validation predictions with ``config`` (keyword ``settings`` replace
        its fields: ``Calibration.fit(val, score="mds", keep=0.9)``): the temperature minimising
        their NLL, then the flag at it (`Flag.fit`; score ``"auto"``: `choose_flag_score`, which
        may read ``ood_validation``), and the prediction sets (`PredictionSets.fit`; the inputs
        split by position: `split_for_sets`). ``statistics``: the feature scores' statistics.
        ``provenance``: the data each part was read from (the statistics' data recorded only with
        ``statistics``, the OOD validation data only where it chose the flag score). ``id_scores``:
        the flag score's values on ``id_validation`` where computed elsewhere (an exported graph's
        ``ood_score``); the flag is then fit on them."""
        config = CalibrationConfig.merged(config, settings)
        n = _checked_fit(id_validation, config, id_scores)
        # with sets, half the inputs fit the temperature, the other half the sets
        temperature_on, sets_on = (
            split_for_sets(id_validation) if config.set_method else (id_validation, None)
        )
        temperature = float(fit_temperature(temperature_on))
        score = config.score
        if score == AUTO_SCORE:
            score = choose_flag_score(id_validation, statistics, ood_validation, temperature)
        if id_scores is None:
            id_scores = ood_scores(id_validation, score, temperature, statistics)
        elif np.shape(id_scores) != (n,):
            raise InputError(f"id_scores must hold one score per ID validation input, {n} of them")
        chose = config.score == AUTO_SCORE and ood_validation is not None
        return cls(
            temperature,
            Flag.fit(score, np.asarray(id_scores, dtype=float), config, statistics),
            PredictionSets.fit(sets_on, temperature, config) if sets_on is not None else None,
            Provenance(
                provenance.validation,
                provenance.statistics if statistics is not None else NO_DATA,
                provenance.ood if chose else NO_DATA,
            ),
            n,
            precision,
            model_sha256,
        )

    @property
    def config(self) -> CalibrationConfig:
        """The settings this calibration was fit with (its flag score as chosen: never ``auto``;
        without sets, the sets' settings are the defaults)."""
        flag, sets = self.flag, self.sets
        sets_settings = (
            {"set_method": sets.method, "set_alpha": sets.alpha, "set_classwise": sets.classwise}
            if sets is not None
            else {"set_method": ""}
        )
        return CalibrationConfig(score=flag.score, keep=flag.keep, flag_method=flag.method, **sets_settings)

    def with_statistics(self, statistics: FeatureStatistics) -> Calibration:
        """This calibration with its flag's feature statistics (read back beside a saved record)."""
        return dataclasses.replace(self, flag=dataclasses.replace(self.flag, statistics=statistics))

    def prediction_sets(self, predictions: Predictions) -> np.ndarray:
        """Each input's conformal prediction set, (N, C) booleans, from its calibrated ensemble
        probabilities (`PredictionSets`)."""
        if self.sets is None:
            raise InputError("this calibration has no prediction sets (fit it with set_method)")
        return self.sets.of(predictions.probs(self.temperature))

    def records(self, predictions: Predictions, classes: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One record per input (`per_example`), calibrated and flagged with these settings; a
        conformal flag adds each input's ``ood_p_value``, prediction sets its ``prediction_set``
        and ``set_size``."""
        flag = self.flag
        records = per_example(
            predictions, classes, self.temperature, flag.score, flag.threshold, flag.statistics
        )
        if flag.method == "conformal":
            p_values = flag.p_values([r[f"ood_score_{flag.score}"] for r in records])
            for record, p_value in zip(records, p_values, strict=True):
                record["ood_p_value"] = float(p_value)
        if self.sets is not None:
            names = list(classes) if classes else [str(c) for c in range(predictions.num_classes)]
            for record, members in zip(records, self.prediction_sets(predictions), strict=True):
                record["prediction_set"] = [names[c] for c in np.flatnonzero(members)]
                record["set_size"] = int(members.sum())
        return records

    def describe(self) -> str:
        """One line: the settings and the data they were fit on."""
        return _describe(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record, a part each (the statistics are saved beside it and named by their
        digest), with its own SHA-256 (``record_sha256``): a record edited by hand is refused by
        `from_dict`."""
        record = {
            "temperature": self.temperature,
            "flag": self.flag.to_dict(),
            "sets": None if self.sets is None else self.sets.to_dict(),
            "provenance": self.provenance.to_dict(),
            "examples": self.examples,
            "precision": self.precision,
            "model_sha256": self.model_sha256,
        }
        return {**record, RECORD_DIGEST: json_digest(record)}

    @classmethod
    def from_dict(cls, saved: Any) -> Calibration:
        """A calibration from its saved record (`to_dict`, or the flat record of earlier
        versions); InputError naming what is wrong or missing."""
        if not isinstance(saved, dict):
            raise InputError(f"a saved calibration is a JSON object, got {type(saved).__name__}")
        saved = dict(saved)
        digest = saved.pop(RECORD_DIGEST, None)  # the oldest saves lack it
        if digest is not None and digest != json_digest(saved):
            raise InputError(
                "a saved calibration does not match its own checksum: its temperature, score, threshold "
                "or data were edited after it was fit (fit it again with --val-data)"
            )
        try:
            return _from_parts(saved) if "flag" in saved else _from_flat(saved)
        except (TypeError, ValueError, KeyError) as exc:
            raise InputError(f"a saved calibration is malformed: {exc}") from None


_FIELDS = ("temperature", "flag", "sets", "provenance", "examples", "precision", "model_sha256")


def _from_parts(saved: dict[str, Any]) -> Calibration:
    """A calibration from the record `Calibration.to_dict` writes (its digest removed)."""
    if set(saved) != set(_FIELDS):
        raise InputError(
            f"a saved calibration has the fields {sorted(_FIELDS)}; this one has {sorted(saved)}"
        )
    return Calibration(
        temperature=float(saved["temperature"]),
        flag=Flag.from_dict(saved["flag"]),
        sets=None if saved["sets"] is None else PredictionSets.from_dict(saved["sets"]),
        provenance=Provenance.from_dict(saved["provenance"]),
        examples=int(saved["examples"]),
        precision=str(saved["precision"]),
        model_sha256=str(saved["model_sha256"]),
    )


_FLAT_REQUIRED = {"temperature", "score", "threshold", "keep", "data", "data_sha256", "examples", "precision",
                  "model_sha256"}  # fmt: skip
_FLAT_OPTIONAL = {  # added over earlier versions: older saves lack them
    "statistics_sha256", "statistics_data", "statistics_data_sha256", "flag_method", "calibration_scores",
    "set_method", "set_alpha", "set_classwise", "set_quantiles", "set_examples", "ood_data",
    "ood_data_sha256",
}  # fmt: skip


def _from_flat(saved: dict[str, Any]) -> Calibration:
    """A calibration from the flat record earlier versions saved (one field per setting)."""
    if not _FLAT_REQUIRED <= set(saved) <= _FLAT_REQUIRED | _FLAT_OPTIONAL:
        fields = sorted(_FLAT_REQUIRED | _FLAT_OPTIONAL)
        raise InputError(f"a saved calibration has the fields {fields}; this one has {sorted(saved)}")
    flag = Flag(
        score=str(saved["score"]),
        threshold=float(saved["threshold"]),
        keep=float(saved["keep"]),
        method=str(saved.get("flag_method", "quantile")),
        calibration_scores=tuple(float(s) for s in saved.get("calibration_scores", ())),
        statistics_sha256=str(saved.get("statistics_sha256", "")),
    )
    sets = None
    if saved.get("set_method", ""):
        sets = PredictionSets(
            method=str(saved["set_method"]),
            alpha=float(saved.get("set_alpha", 0.1)),
            classwise=bool(saved.get("set_classwise", False)),
            quantiles=tuple(math.inf if q is None else float(q) for q in saved.get("set_quantiles", ())),
            examples=int(saved.get("set_examples", 0)),
        )
    provenance = Provenance(
        DataRecord(str(saved["data"]), str(saved["data_sha256"])),
        DataRecord(str(saved.get("statistics_data", "")), str(saved.get("statistics_data_sha256", ""))),
        DataRecord(str(saved.get("ood_data", "")), str(saved.get("ood_data_sha256", ""))),
    )
    return Calibration(
        float(saved["temperature"]), flag, sets, provenance, int(saved["examples"]), str(saved["precision"]),
        str(saved["model_sha256"]),
    )  # fmt: skip


def _checked_fit(id_validation: Predictions, config: CalibrationConfig, id_scores: Any) -> int:
    """The number of ID validation inputs `Calibration.fit` fits on, checked against ``config``
    (`check_calibration_data`) and ``id_scores`` (the values of one named score)."""
    if id_scores is not None and config.score == AUTO_SCORE:
        raise InputError("id_scores are the values of one named score: name it, not 'auto'")
    labels = id_validation.class_labels("ID validation predictions")
    check_calibration_data(labels, config, classes=id_validation.num_classes)
    check_finite_logits(id_validation.member_logits)  # named by their index in all the inputs
    return len(labels)


def _describe(c: Calibration) -> str:
    """One line: the settings and the data they were fit on."""
    read = c.provenance
    validation = read.validation
    fit_on = (
        f"{validation.name or 'ID validation data'} ({c.examples} inputs, sha256 {validation.sha256[:12]})"
    )
    statistics = ""
    if c.flag.statistics_sha256:
        about = [f"{c.flag.statistics.settings['examples']} inputs"] if c.flag.statistics is not None else []
        about += [f"sha256 {read.statistics.sha256[:12]}"] if read.statistics.sha256 else []
        named = read.statistics.name or "ID training data"
        statistics = f"; feature statistics fit on {named}" + (f" ({', '.join(about)})" if about else "")
    sets = f"; sets: {c.sets.coverage()}" if c.sets is not None else ""
    chosen = (
        f"; flag score chosen on {read.ood.name or 'OOD validation data'} (sha256 {read.ood.sha256[:12]})"
        if read.ood.sha256
        else ""
    )
    return (
        f"temperature {c.temperature:.3f}; flag: ood_score_{c.flag.score} > {c.flag.threshold:.4f} "
        f"({c.flag.level()}); fit on {fit_on}"
        + (f" in {c.precision}" if c.precision else "")
        + statistics
        + sets
        + chosen
    )


def check_calibration_data(
    validation: Sequence[dict[str, Any]] | Any, config: CalibrationConfig, model: Any = None, classes: int = 0
) -> None:
    """Refuse, before any work, labelled ID validation data (batches, or their labels) that cannot
    fit ``config``'s calibration: prediction sets need at least two inputs (the even ones fit the
    temperature, the odd ones the sets: `split_for_sets`); the temperature needs inputs of at
    least two classes among those that fit it (`check_temperature_data`); per-class (Mondrian)
    sets need inputs of every class of ``model`` among those that fit the sets, since a class
    absent there would be in every set. ``model``: the classifier to be calibrated (its classes),
    or ``classes``: their number (neither: those the labels show)."""
    if isinstance(validation, Sequence) and validation and isinstance(validation[0], dict):
        labels = np.concatenate(
            [np.asarray(b["labels"]).reshape(-1) for b in validation if "labels" in b] or [[]]
        )
    else:
        labels = np.asarray(validation).reshape(-1)
    labels = labels.astype(np.int64)
    if config.set_method and len(labels) < 2:
        raise InputError(
            f"prediction sets need at least 2 labelled validation inputs (one half fits the temperature, "
            f"the other the sets), got {len(labels)}: give more validation data, or no sets"
        )
    names = model_class_names(model) if model is not None else None
    check_temperature_data(labels[0::2] if config.set_method else labels, classes=names)
    if config.set_method and config.set_classwise:
        classes = num_model_labels(model) if model is not None else classes or int(labels.max()) + 1
        absent = sorted(set(range(classes)) - set(labels[1::2].tolist()))
        if absent:
            named = ", ".join(repr(names[c]) if names else str(c) for c in absent)
            raise InputError(
                f"per-class (Mondrian) prediction sets need validation inputs of every class among those "
                f"that fit the sets (every second input), and there are none of {named}: every set would "
                "hold that class; give validation data of every class, or sets over all classes"
            )
