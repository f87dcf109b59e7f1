"""A model's calibration, fit once on labelled ID validation data and saved with the model.

A `Calibration` holds what turns a model's logits into calibrated probabilities and an OOD flag:
the temperature (one, shared by the members), the OOD score that decides the flag (higher = more
likely OOD), the score's threshold (the value at or below which a share ``keep`` of the ID
validation inputs fall), and what it was fit on: the data's name, the SHA-256 of its batches,
the number of inputs, the precision the predictions were computed in, and the SHA-256 of the
model's weights (`surgery.fingerprint`): a calibration is refused for any other weights.

`calibrate` fits it and records it in the model's configuration (``config.hydra_calibration``;
pruning, fusing and fine-tuning a model leave the new model without it),
which `save_pretrained` of a Hugging Face model, `save_member` and `HydraModel.save_pretrained`
write with the configuration (and so cover by their checksums); `saved_calibration` reads it back
from a loaded model. `hydra-ens predict` and `Calibration.records` then give calibrated, flagged
records with no validation data at hand. Never fit a calibration on OOD test data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..hashing import batches_digest
from ..precision import model_device, resolve_precision
from ..surgery import CALIBRATION_KEY, fingerprint
from .evaluate import OOD_SCORES
from .predict import Predictions, predict
from .temperature import fit_temperature
from .uncertainty import flag_threshold, per_example


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

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"calibration temperature must be positive and finite, got {self.temperature}")
        if self.score not in OOD_SCORES:
            raise ValueError(f"unknown OOD score {self.score!r}; choose from {OOD_SCORES}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"calibration threshold must be finite, got {self.threshold}")
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")
        if self.examples < 1:
            raise ValueError(f"a calibration is fit on at least one input, got {self.examples}")

    @classmethod
    def fit(
        cls,
        id_validation: Predictions,
        score: str = "msp",
        keep: float = 0.95,
        *,
        data: str = "",
        data_sha256: str = "",
        precision: str = "",
        model_sha256: str = "",
    ) -> Calibration:
        """Fit on labelled ID validation predictions: the temperature minimising their NLL, then the
        threshold of ``score`` (at that temperature) that keeps ``keep`` of them unflagged."""
        temperature = float(fit_temperature(id_validation))
        threshold = flag_threshold(id_validation, score, keep, temperature)
        examples = len(id_validation.labels)
        return cls(temperature, score, threshold, keep, data, data_sha256, examples, precision, model_sha256)

    def records(self, predictions: Predictions, classes: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One record per input (`per_example`), calibrated and flagged with these settings."""
        return per_example(predictions, classes, self.temperature, self.score, self.threshold)

    def describe(self) -> str:
        """One line: the settings and the data they were fit on."""
        fit_on = (
            f"{self.data or 'ID validation data'} ({self.examples} inputs, sha256 {self.data_sha256[:12]})"
        )
        return (
            f"temperature {self.temperature:.3f}; flag: ood_score_{self.score} > {self.threshold:.4f} "
            f"(keeps {self.keep:.0%} of ID validation); fit on {fit_on}"
            + (f" in {self.precision}" if self.precision else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Any) -> Calibration:
        """A calibration from its saved dict; ValueError naming what is wrong or missing."""
        if not isinstance(saved, dict):
            raise ValueError(f"a saved calibration is a JSON object, got {type(saved).__name__}")
        fields = set(cls.__dataclass_fields__)
        if set(saved) != fields:
            raise ValueError(
                f"a saved calibration has the fields {sorted(fields)}; this one has {sorted(saved)}"
            )
        try:
            return cls(
                temperature=float(saved["temperature"]),
                score=str(saved["score"]),
                threshold=float(saved["threshold"]),
                keep=float(saved["keep"]),
                data=str(saved["data"]),
                data_sha256=str(saved["data_sha256"]),
                examples=int(saved["examples"]),
                precision=str(saved["precision"]),
                model_sha256=str(saved["model_sha256"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a saved calibration is malformed: {exc}") from None


def fit_calibration(
    model: Any,
    id_validation: Iterable[dict[str, Any]],
    score: str = "msp",
    keep: float = 0.95,
    *,
    data: str = "",
    precision: str = "auto",
    progress: bool = True,
) -> tuple[Calibration, Predictions]:
    """A `Calibration` of ``model`` (any model or ensemble `predict` takes, a list of models
    included) fit on labelled ID validation batches, with the predictions it was fit on; nothing
    is recorded in the model (`calibrate` does, for one model)."""
    batches = list(id_validation)
    if not batches or not all("labels" in batch for batch in batches):
        raise ValueError("calibration needs labelled ID validation batches (every batch with labels)")
    compute = resolve_precision(precision, model_device(model))
    predictions = predict(model, batches, "calibration", progress=progress, precision=precision)
    calibration = Calibration.fit(
        predictions, score, keep, data=data, data_sha256=batches_digest(batches), precision=compute.name
    )
    return calibration, predictions


def calibrate(
    model: Any,
    id_validation: Iterable[dict[str, Any]],
    score: str = "msp",
    keep: float = 0.95,
    *,
    data: str = "",
    precision: str = "auto",
    progress: bool = True,
) -> Calibration:
    """Fit ``model``'s `Calibration` on labelled ID validation batches (`fit_calibration`), bind
    it to the model's weights and record it in its configuration (saved with the model from then
    on). ``model`` is a Hydra model, a member, an ensemble of members or a Hugging Face
    classifier; ``data`` names the batches' source in the record."""
    fitted, _ = fit_calibration(
        model, id_validation, score, keep, data=data, precision=precision, progress=progress
    )
    calibration = dataclasses.replace(fitted, model_sha256=fingerprint(model))
    setattr(model.config, CALIBRATION_KEY, calibration.to_dict())
    return calibration


def saved_calibration(model: Any) -> Calibration | None:
    """The `Calibration` recorded in ``model``'s configuration, or None where it has none."""
    saved = getattr(getattr(model, "config", None), CALIBRATION_KEY, None)
    if saved is None:
        return None
    calibration = Calibration.from_dict(saved)
    if calibration.model_sha256 != fingerprint(model):
        raise ValueError(
            "the calibration recorded in the model's configuration was fit on other weights (the model "
            "was trained, pruned or cast since): fit it again (evaluation.calibrate, or --val-data)"
        )
    return calibration
