"""A model's calibration, fit once on labelled ID validation data and saved with the model.

A `Calibration` holds what turns a model's logits into calibrated probabilities and an OOD flag:
the temperature (one, shared by the members), the OOD score that decides the flag (higher = more
likely OOD), the score's threshold (the value at or below which a share ``keep`` of the ID
validation inputs fall), and what it was fit on: the data's name, the SHA-256 of its batches,
the number of inputs, the precision the predictions were computed in, and the SHA-256 of the
model's weights (`surgery.fingerprint`): a calibration is refused for any other weights. Where
the model's training data was given, it also holds the feature statistics of the feature-space
OOD scores (`ood.FeatureStatistics`, fit on the members' features of that data), named by their
digest and by the data they were fit on; the flag score is then chosen by `choose_flag_score`.

`model_calibration.calibrate` fits it on a model and records it in the model's metadata
(`saving.metadata`; pruning, fusing and fine-tuning a model leave the new model without it),
which `save_pretrained` of a Hugging Face model, `save_member` and `HydraModel.save_pretrained`
write with the configuration (and so cover by their checksums); `saved_calibration` reads it back
from a loaded model. `hydra-ens predict` and `Calibration.records` then give calibrated, flagged
records with no validation data at hand. Never fit a calibration on OOD test data.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.labels import model_class_names, num_model_labels
from ..errors import InputError
from ..hashing import json_digest
from ..ood.detectors import FeatureStatistics
from ..ood.registry import feature_scores, reads_layers
from .conformal import (
    conformal_p_values,
    conformal_threshold,
    fit_set_quantiles,
    one_draw_range,
    prediction_sets,
    quantile_threshold,
    smallest_alpha,
)
from .evaluate import ood_score_names, ood_scores
from .flag_score import choose_flag_score
from .predict import Predictions
from .provenance import NO_DATA, NOTHING_READ, DataRecord, Provenance
from .settings import AUTO_SCORE, SET_METHODS, CalibrationConfig, check_flag_settings
from .temperature import check_finite_logits, check_temperature_data, fit_temperature
from .uncertainty import per_example

RECORD_DIGEST = "record_sha256"
"""The key of a saved calibration record's own SHA-256."""


@dataclass(frozen=True)
class Calibration:
    """Temperature, OOD score and flag threshold of one model, and the data they were fit on."""

    temperature: float
    score: str
    threshold: float
    keep: float
    data: str
    data_sha256: str
    examples: int
    precision: str
    model_sha256: str = ""
    statistics_sha256: str = ""
    statistics_data: str = ""
    statistics_data_sha256: str = ""
    flag_method: str = "quantile"
    calibration_scores: tuple[float, ...] = ()
    set_method: str = ""
    set_alpha: float = 0.1
    set_classwise: bool = False
    set_quantiles: tuple[float, ...] = ()
    set_examples: int = 0
    ood_data: str = ""
    """The OOD validation data the flag score was chosen on (``score="auto"``), where any."""
    ood_data_sha256: str = ""
    statistics: FeatureStatistics | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(f"calibration temperature must be positive and finite, got {self.temperature}")
        if self.score not in ood_score_names():
            raise InputError(f"unknown OOD score {self.score!r}; choose from {ood_score_names()}")
        if not math.isfinite(self.threshold):
            raise InputError(f"calibration threshold must be finite, got {self.threshold}")
        check_flag_settings(self.keep, self.flag_method)
        if self.examples < 1:
            raise InputError(f"a calibration is fit on at least one input, got {self.examples}")
        if self.score in feature_scores() and not self.statistics_sha256:
            raise InputError(
                f"the flag score {self.score!r} needs feature statistics; the calibration has none"
            )
        if self.statistics is not None and self.statistics.digest() != self.statistics_sha256:
            raise InputError("the feature statistics are not the ones this calibration records")
        if self.set_method and (self.set_method not in SET_METHODS or not self.set_quantiles):
            raise InputError(f"prediction sets need a method of {SET_METHODS} and their quantiles")
        if self.flag_method == "conformal":
            object.__setattr__(self, "calibration_scores", tuple(sorted(map(float, self.calibration_scores))))
            if not self.calibration_scores:
                raise InputError(
                    "a conformal flag keeps the ID calibration scores; this calibration has none"
                )
            threshold = conformal_threshold(self.calibration_scores, 1 - self.keep)
            if threshold != self.threshold and self.threshold != _rounded_rule(
                self.calibration_scores, self.keep
            ):
                raise InputError("the conformal flag's threshold does not follow from its calibration scores")
            if threshold != self.threshold:  # saved by a version whose level rounded onto a p-value
                warnings.warn(  # grid point: its flag now agrees with its reported p-values
                    f"the saved conformal flag's level {1 - self.keep:.17g} sits on a p-value grid point "
                    f"that an earlier version rounded onto; it flags where the p-value is <= the level "
                    f"(threshold {self.threshold:.6g} -> {threshold:.6g})",
                    stacklevel=2,
                )
                object.__setattr__(self, "threshold", threshold)

    @property
    def alpha(self) -> float:
        """The flag's level: the share of ID inputs it may flag (1 - ``keep``)."""
        return 1.0 - self.keep

    def sets(self, predictions: Predictions) -> np.ndarray:
        """Each input's conformal prediction set, (N, C) booleans, from its calibrated ensemble
        probabilities: it holds the true class of an exchangeable ID input with probability at
        least 1 - ``set_alpha`` (for every class, with ``set_classwise``)."""
        if not self.set_method:
            raise InputError("this calibration has no prediction sets (fit it with set_method)")
        quantiles = [math.inf if q is None else q for q in self.set_quantiles]
        return prediction_sets(predictions.probs(self.temperature), quantiles, self.set_method)

    def p_values(self, scores: Any) -> np.ndarray:
        """The conformal p-value of each OOD score against the ID calibration scores (a conformal
        flag only): an input is flagged exactly where its p-value is <= `alpha`."""
        if self.flag_method != "conformal":
            raise InputError("p-values need a conformal flag (its calibration scores)")
        return conformal_p_values(self.calibration_scores, scores)

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
        their NLL, then the flag's threshold at it (`CalibrationConfig`; ``"auto"``:
        `choose_flag_score`, which may read ``ood_validation``), and the prediction sets'
        quantiles (the inputs split by position: `split_for_sets`). ``statistics``: the feature
        scores' statistics. ``provenance``: the data each part was read from (the OOD validation
        data recorded only where it chose the flag score). ``id_scores``: the flag score's values
        on ``id_validation`` where computed elsewhere (an exported graph's ``ood_score``); the
        flag is then fit on them."""
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
        flag = _fit_flag(np.asarray(id_scores, dtype=float), config.keep, config.flag_method)
        chose = config.score == AUTO_SCORE and ood_validation is not None
        return cls(
            **dataclasses.asdict(config.replace(score=score, flag_method=flag.pop("flag_method"))),
            **flag,
            **_fit_sets(sets_on, temperature, config),
            **_provenance_fields(provenance, statistics, chose),
            temperature=temperature,
            examples=n,
            precision=precision,
            model_sha256=model_sha256,
            statistics=statistics,
        )

    @property
    def provenance(self) -> Provenance:
        """What each part was fit on: the ID validation data, the feature statistics' training
        data, the OOD validation data the flag score was chosen on (empty records where none)."""
        return Provenance(
            DataRecord(self.data, self.data_sha256),
            DataRecord(self.statistics_data, self.statistics_data_sha256),
            DataRecord(self.ood_data, self.ood_data_sha256),
        )

    @property
    def config(self) -> CalibrationConfig:
        """The settings this calibration was fit with (its flag score as chosen: never ``auto``)."""
        return CalibrationConfig(
            self.score, self.keep, self.flag_method, self.set_method, self.set_alpha, self.set_classwise
        )

    @property
    def reads_layers(self) -> bool:
        """Whether the flag score reads every layer's features (`predict` them with ``layers=True``)."""
        return reads_layers(self.score)

    def records(self, predictions: Predictions, classes: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One record per input (`per_example`), calibrated and flagged with these settings; a
        conformal flag adds each input's ``ood_p_value``."""
        records = per_example(
            predictions, classes, self.temperature, self.score, self.threshold, self.statistics
        )
        if self.flag_method == "conformal":
            p_values = self.p_values([r[f"ood_score_{self.score}"] for r in records])
            for record, p_value in zip(records, p_values, strict=True):
                record["ood_p_value"] = float(p_value)
        if self.set_method:
            names = list(classes) if classes else [str(c) for c in range(predictions.num_classes)]
            for record, members in zip(records, self.sets(predictions), strict=True):
                record["prediction_set"] = [names[c] for c in np.flatnonzero(members)]
                record["set_size"] = int(members.sum())
        return records

    def describe(self) -> str:
        """One line: the settings and the data they were fit on."""
        return _describe(self)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (the statistics are saved beside it and named by their digest), with
        its own SHA-256 (``record_sha256``): a record edited by hand is refused by `from_dict`."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "statistics"}
        record["calibration_scores"] = list(self.calibration_scores)  # as JSON holds it
        record["set_quantiles"] = [q if math.isfinite(q) else None for q in self.set_quantiles]
        return {**record, RECORD_DIGEST: json_digest(record)}

    @classmethod
    def from_dict(cls, saved: Any) -> Calibration:
        """A calibration from its saved dict; InputError naming what is wrong or missing."""
        return _calibration_from_dict(saved)


def _provenance_fields(
    provenance: Provenance, statistics: FeatureStatistics | None, ood_chose: bool
) -> dict[str, str]:
    """A `Calibration`'s fields of what it was fit on: ``provenance``'s records (the statistics'
    data only with ``statistics``, the OOD validation data only where it chose the flag score:
    ``ood_chose``) and the digest of the ``statistics`` (empty where none)."""
    data = provenance.statistics if statistics is not None else NO_DATA
    ood = provenance.ood if ood_chose else NO_DATA
    return {
        "data": provenance.validation.name,
        "data_sha256": provenance.validation.sha256,
        "statistics_sha256": statistics.digest() if statistics is not None else "",
        "statistics_data": data.name,
        "statistics_data_sha256": data.sha256,
        "ood_data": ood.name,
        "ood_data_sha256": ood.sha256,
    }


def _checked_fit(id_validation: Predictions, config: CalibrationConfig, id_scores: Any) -> int:
    """The number of ID validation inputs `Calibration.fit` fits on, checked against ``config``
    (`check_calibration_data`) and ``id_scores`` (the values of one named score)."""
    if id_scores is not None and config.score == AUTO_SCORE:
        raise InputError("id_scores are the values of one named score: name it, not 'auto'")
    labels = id_validation.class_labels("ID validation predictions")
    check_calibration_data(labels, config, classes=id_validation.num_classes)
    check_finite_logits(id_validation.member_logits)  # named by their index in all the inputs
    return len(labels)


def _fit_flag(id_scores: np.ndarray, keep: float, flag_method: str) -> dict[str, Any]:
    """The flag's ``threshold``, ``flag_method`` and kept ``calibration_scores`` on the ID scores:
    conformal where ``len(id_scores)`` inputs can give level 1 - ``keep`` its guarantee, else the
    plain quantile (with a warning)."""
    n = len(id_scores)
    if flag_method == "conformal" and 1 - keep < smallest_alpha(n):
        warnings.warn(
            f"{n} ID validation inputs cannot flag at level {1 - keep:.3g} with its guarantee (that "
            f"needs at least {math.ceil(1 / (1 - keep)) - 1 if keep < 1 else 'infinitely many'}): "
            "the plain quantile sets the threshold, without the guarantee",
            stacklevel=3,
        )
        flag_method = "quantile"
    if flag_method == "conformal":
        kept = tuple(float(s) for s in id_scores)
        return {"threshold": conformal_threshold(kept, 1 - keep), "flag_method": flag_method,
                "calibration_scores": kept}  # fmt: skip
    return {
        "threshold": quantile_threshold(id_scores, keep),
        "flag_method": flag_method,
        "calibration_scores": (),
    }


def _fit_sets(sets_on: Predictions | None, temperature: float, config: CalibrationConfig) -> dict[str, Any]:
    """The prediction sets' ``set_quantiles`` and ``set_examples``, fit on ``sets_on`` (None: no
    sets) at ``temperature``."""
    if sets_on is None:
        return {"set_quantiles": (), "set_examples": 0}
    probs, labels = sets_on.probs(temperature), sets_on.class_labels()
    quantiles = fit_set_quantiles(probs, labels, config.set_alpha, config.set_method, config.set_classwise)
    return {"set_quantiles": tuple(float(q) for q in quantiles), "set_examples": len(labels)}


def _rounded_rule(scores: tuple[float, ...], keep: float) -> float:
    """The conformal threshold as earlier versions computed it (k = ceil((n + 1) keep - 1e-12)),
    which moved a level within 1e-12 of a p-value grid point onto it: a saved calibration with
    that threshold still loads (`Calibration` then holds the threshold its p-values follow)."""
    k = min(len(scores), max(1, math.ceil((len(scores) + 1) * (1 - (1 - keep)) - 1e-12)))
    return float(scores[k - 1])


def _describe(c: Calibration) -> str:
    """One line: the settings and the data they were fit on."""
    fit_on = f"{c.data or 'ID validation data'} ({c.examples} inputs, sha256 {c.data_sha256[:12]})"
    statistics = ""
    if c.statistics_sha256:
        about = [f"{c.statistics.settings['examples']} inputs"] if c.statistics is not None else []
        about += [f"sha256 {c.statistics_data_sha256[:12]}"] if c.statistics_data_sha256 else []
        named = c.statistics_data or "ID training data"
        statistics = f"; feature statistics fit on {named}" + (f" ({', '.join(about)})" if about else "")
    level = f"keeps {c.keep:.0%} of ID validation"
    if c.flag_method == "conformal":
        ceiling = one_draw_range(len(c.calibration_scores), c.alpha)[1]
        level = (
            f"conformal, level {c.alpha:.3g}: at most {c.alpha:.1%} of ID inputs flagged in expectation, "
            f"under {ceiling:.1%} for 95% of draws of {len(c.calibration_scores)} validation inputs"
        )
    sets = ""
    if c.set_method:
        floor = 1 - one_draw_range(c.set_examples, c.set_alpha)[1] if c.set_examples else 1 - c.set_alpha
        sets = (
            f"; sets: {c.set_method}, coverage at least {1 - c.set_alpha:.0%} in expectation, above "
            f"{floor:.1%} for 95% of draws of {c.set_examples} inputs"
        )
    chosen = (
        f"; flag score chosen on {c.ood_data or 'OOD validation data'} (sha256 {c.ood_data_sha256[:12]})"
        if c.ood_data_sha256
        else ""
    )
    return (
        f"temperature {c.temperature:.3f}; flag: ood_score_{c.score} > {c.threshold:.4f} "
        f"({level}); fit on {fit_on}"
        + (f" in {c.precision}" if c.precision else "")
        + statistics
        + sets
        + chosen
    )


def _calibration_from_dict(saved: Any) -> Calibration:
    """A calibration from its saved dict; ValueError naming what is wrong or missing."""
    if not isinstance(saved, dict):
        raise InputError(f"a saved calibration is a JSON object, got {type(saved).__name__}")
    saved = dict(saved)
    digest = saved.pop(RECORD_DIGEST, None)  # older saves lack it
    if digest is not None and digest != json_digest(saved):
        raise InputError(
            "a saved calibration does not match its own checksum: its temperature, score, threshold "
            "or data were edited after it was fit (fit it again with --val-data)"
        )
    fields = set(Calibration.__dataclass_fields__) - {"statistics"}
    optional = {"statistics_sha256", "statistics_data", "statistics_data_sha256"}  # older saves lack them
    optional |= {"flag_method", "calibration_scores", "set_method", "set_alpha", "set_classwise"}
    optional |= {"set_quantiles", "set_examples", "ood_data", "ood_data_sha256"}
    if not fields - optional <= set(saved) <= fields:
        raise InputError(f"a saved calibration has the fields {sorted(fields)}; this one has {sorted(saved)}")
    try:
        return Calibration(
            temperature=float(saved["temperature"]),
            score=str(saved["score"]),
            threshold=float(saved["threshold"]),
            keep=float(saved["keep"]),
            data=str(saved["data"]),
            data_sha256=str(saved["data_sha256"]),
            examples=int(saved["examples"]),
            precision=str(saved["precision"]),
            model_sha256=str(saved["model_sha256"]),
            **{
                name: str(saved[name]) for name in optional if name in saved and name.startswith("statistics")
            },
            flag_method=str(saved.get("flag_method", "quantile")),
            calibration_scores=tuple(float(s) for s in saved.get("calibration_scores", ())),
            set_method=str(saved.get("set_method", "")),
            set_alpha=float(saved.get("set_alpha", 0.1)),
            set_classwise=bool(saved.get("set_classwise", False)),
            set_quantiles=tuple(math.inf if q is None else float(q) for q in saved.get("set_quantiles", ())),
            set_examples=int(saved.get("set_examples", 0)),
            ood_data=str(saved.get("ood_data", "")),
            ood_data_sha256=str(saved.get("ood_data_sha256", "")),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"a saved calibration is malformed: {exc}") from None


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


def split_for_sets(id_validation: Predictions) -> tuple[Predictions, Predictions]:
    """The validation predictions split by position: the even inputs (0, 2, ...) fit the
    temperature, the odd ones calibrate the prediction sets at that temperature. Kept apart,
    the sets' coverage guarantee does not depend on the temperature's fit."""
    labels = id_validation.class_labels("prediction sets' labelled validation data")
    features, layers = id_validation.member_features, id_validation.layer_features

    def part(start: int) -> Predictions:
        rows = slice(start, None, 2)
        return Predictions(
            id_validation.member_logits[:, rows],
            labels[rows],
            None if features is None else features[:, rows],
            None if layers is None else layers[:, rows],
        )

    return part(0), part(1)
