"""A calibration's parts beside its temperature, each fit and saved on its own: the OOD flag
(`Flag`: its score, the feature statistics a feature score reads, its threshold) and the
conformal prediction sets (`PredictionSets`). `Calibration` holds one of each (the sets where
asked for) with the temperature and the records of the data each part was fit on."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from ..evaluation.conformal import (
    conformal_p_values,
    conformal_threshold,
    fit_set_quantiles,
    one_draw_range,
    prediction_sets,
    quantile_threshold,
    smallest_alpha,
)
from ..evaluation.evaluate import ood_score_names
from ..evaluation.predict import Predictions
from ..ood.detectors import FeatureStatistics
from ..ood.registry import feature_scores, reads_layers
from .settings import SET_METHODS, CalibrationConfig, check_flag_settings


@dataclass(frozen=True)
class Flag:
    """The OOD flag: an input is flagged where its ``score`` (higher = more likely OOD) is not at
    or below ``threshold``, the value that leaves a share ``keep`` of the ID validation inputs
    unflagged. ``method``: ``"conformal"`` (the (n + 1)-corrected threshold of the kept
    ``calibration_scores``, which give each input its p-value) or ``"quantile"``. A feature score
    reads ``statistics`` (`ood.FeatureStatistics`), named by their digest ``statistics_sha256``."""

    score: str
    threshold: float
    keep: float
    method: str = "quantile"
    calibration_scores: tuple[float, ...] = ()
    statistics_sha256: str = ""
    statistics: FeatureStatistics | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.score not in ood_score_names():
            raise InputError(f"unknown OOD score {self.score!r}; choose from {ood_score_names()}")
        if not math.isfinite(self.threshold):
            raise InputError(f"calibration threshold must be finite, got {self.threshold}")
        check_flag_settings(self.keep, self.method)
        if self.score in feature_scores() and not self.statistics_sha256:
            raise InputError(
                f"the flag score {self.score!r} needs feature statistics; the calibration has none"
            )
        if self.statistics is not None and self.statistics.digest() != self.statistics_sha256:
            raise InputError("the feature statistics are not the ones this calibration records")
        if self.method == "conformal":
            self._check_conformal()

    def _check_conformal(self) -> None:
        """The kept calibration scores, sorted, and the threshold that follows from them."""
        object.__setattr__(self, "calibration_scores", tuple(sorted(map(float, self.calibration_scores))))
        if not self.calibration_scores:
            raise InputError("a conformal flag keeps the ID calibration scores; this calibration has none")
        threshold = conformal_threshold(self.calibration_scores, self.alpha)
        if threshold != self.threshold and self.threshold != _rounded_rule(
            self.calibration_scores, self.keep
        ):
            raise InputError("the conformal flag's threshold does not follow from its calibration scores")
        if threshold != self.threshold:  # saved by a version whose level rounded onto a p-value
            warnings.warn(  # grid point: its flag now agrees with its reported p-values
                f"the saved conformal flag's level {self.alpha:.17g} sits on a p-value grid point "
                f"that an earlier version rounded onto; it flags where the p-value is <= the level "
                f"(threshold {self.threshold:.6g} -> {threshold:.6g})",
                stacklevel=4,
            )
            object.__setattr__(self, "threshold", threshold)

    @property
    def alpha(self) -> float:
        """The flag's level: the share of ID inputs it may flag (1 - ``keep``)."""
        return 1.0 - self.keep

    @property
    def reads_layers(self) -> bool:
        """Whether the score reads every layer's features (`predict` them with ``layers=True``)."""
        return reads_layers(self.score)

    def p_values(self, scores: Any) -> np.ndarray:
        """The conformal p-value of each OOD score against the ID calibration scores (a conformal
        flag only): an input is flagged exactly where its p-value is <= `alpha`."""
        if self.method != "conformal":
            raise InputError("p-values need a conformal flag (its calibration scores)")
        return conformal_p_values(self.calibration_scores, scores)

    @classmethod
    def fit(
        cls,
        score: str,
        id_scores: np.ndarray,
        config: CalibrationConfig,
        statistics: FeatureStatistics | None,
    ) -> Flag:
        """The flag on the ID validation inputs' values of ``score``: conformal where that many
        inputs can give level 1 - ``config.keep`` its guarantee, else the plain quantile (with a
        warning)."""
        n, keep, method = len(id_scores), config.keep, config.flag_method
        if method == "conformal" and 1 - keep < smallest_alpha(n):
            warnings.warn(
                f"{n} ID validation inputs cannot flag at level {1 - keep:.3g} with its guarantee (that "
                f"needs at least {math.ceil(1 / (1 - keep)) - 1 if keep < 1 else 'infinitely many'}): "
                "the plain quantile sets the threshold, without the guarantee",
                stacklevel=3,
            )
            method = "quantile"
        kept = tuple(float(s) for s in id_scores) if method == "conformal" else ()
        threshold = conformal_threshold(kept, 1 - keep) if kept else quantile_threshold(id_scores, keep)
        digest = statistics.digest() if statistics is not None else ""
        return cls(score, threshold, keep, method, kept, digest, statistics)

    def level(self) -> str:
        """What the flag promises, in words."""
        if self.method != "conformal":
            return f"keeps {self.keep:.0%} of ID validation"
        ceiling = one_draw_range(len(self.calibration_scores), self.alpha)[1]
        return (
            f"conformal, level {self.alpha:.3g}: at most {self.alpha:.1%} of ID inputs flagged in "
            f"expectation, under {ceiling:.1%} for 95% of draws of {len(self.calibration_scores)} "
            "validation inputs"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (the statistics are saved beside the calibration, named by their digest)."""
        return {
            "score": self.score,
            "threshold": self.threshold,
            "keep": self.keep,
            "method": self.method,
            "calibration_scores": list(self.calibration_scores),
            "statistics_sha256": self.statistics_sha256,
        }

    @classmethod
    def from_dict(cls, saved: Any) -> Flag:
        """A flag from its saved record (`to_dict`); InputError naming what is wrong."""
        record = _fields(saved, "flag", {"score", "threshold", "keep", "method", "calibration_scores",
                                         "statistics_sha256"})  # fmt: skip
        return cls(
            score=str(record["score"]),
            threshold=float(record["threshold"]),
            keep=float(record["keep"]),
            method=str(record["method"]),
            calibration_scores=tuple(float(s) for s in record["calibration_scores"]),
            statistics_sha256=str(record["statistics_sha256"]),
        )


@dataclass(frozen=True)
class PredictionSets:
    """Conformal prediction sets: each input's set of classes holds the true class of an
    exchangeable ID input with probability at least 1 - ``alpha`` (for every class, with
    ``classwise``: Mondrian), by the non-conformity score ``method`` (`SET_METHODS`) and its
    ``quantiles`` (one, or one per class) fit on ``examples`` labelled validation inputs."""

    method: str
    alpha: float
    classwise: bool
    quantiles: tuple[float, ...]
    examples: int

    def __post_init__(self) -> None:
        if self.method not in SET_METHODS or not self.quantiles:
            raise InputError(f"prediction sets need a method of {SET_METHODS} and their quantiles")
        if not 0 < self.alpha < 1:
            raise InputError(f"set_alpha must be in (0, 1), got {self.alpha}")

    def of(self, probs: np.ndarray) -> np.ndarray:
        """Each input's set, (N, C) booleans, from its calibrated class probabilities (N, C)."""
        return prediction_sets(probs, self.quantiles, self.method)

    @classmethod
    def fit(cls, sets_on: Predictions, temperature: float, config: CalibrationConfig) -> PredictionSets:
        """The sets of ``config`` fit on the labelled predictions ``sets_on`` at ``temperature``."""
        probs, labels = sets_on.probs(temperature), sets_on.class_labels()
        quantiles = fit_set_quantiles(
            probs, labels, config.set_alpha, config.set_method, config.set_classwise
        )
        return cls(
            config.set_method,
            config.set_alpha,
            config.set_classwise,
            tuple(float(q) for q in quantiles),
            len(labels),
        )

    def coverage(self) -> str:
        """What the sets promise, in words."""
        floor = 1 - one_draw_range(self.examples, self.alpha)[1] if self.examples else 1 - self.alpha
        return (
            f"{self.method}, coverage at least {1 - self.alpha:.0%} in expectation, above "
            f"{floor:.1%} for 95% of draws of {self.examples} inputs"
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (a class no validation input reached has quantile null: it is in every set)."""
        return {
            "method": self.method,
            "alpha": self.alpha,
            "classwise": self.classwise,
            "quantiles": [q if math.isfinite(q) else None for q in self.quantiles],
            "examples": self.examples,
        }

    @classmethod
    def from_dict(cls, saved: Any) -> PredictionSets:
        """Prediction sets from their saved record (`to_dict`); InputError naming what is wrong."""
        record = _fields(saved, "prediction sets", {"method", "alpha", "classwise", "quantiles", "examples"})
        return cls(
            method=str(record["method"]),
            alpha=float(record["alpha"]),
            classwise=bool(record["classwise"]),
            quantiles=tuple(math.inf if q is None else float(q) for q in record["quantiles"]),
            examples=int(record["examples"]),
        )


def _fields(saved: Any, what: str, names: set[str]) -> dict[str, Any]:
    """``saved``, a JSON object with exactly the fields ``names``; InputError otherwise."""
    if not isinstance(saved, dict):
        raise InputError(f"a saved calibration's {what} is a JSON object, got {type(saved).__name__}")
    if set(saved) != names:
        raise InputError(
            f"a saved calibration's {what} has the fields {sorted(names)}; this one has {sorted(saved)}"
        )
    return saved


def _rounded_rule(scores: tuple[float, ...], keep: float) -> float:
    """The conformal threshold as earlier versions computed it (k = ceil((n + 1) keep - 1e-12)),
    which moved a level within 1e-12 of a p-value grid point onto it: a saved calibration with
    that threshold still loads (`Flag` then holds the threshold its p-values follow)."""
    k = min(len(scores), max(1, math.ceil((len(scores) + 1) * (1 - (1 - keep)) - 1e-12)))
    return float(scores[k - 1])
