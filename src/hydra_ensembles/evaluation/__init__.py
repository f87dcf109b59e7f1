"""Evaluation: predictions of any model or ensemble, temperature scaling, metrics, shift, and a
model's calibration (its settings in `settings`, plain Python; the names below load with their
modules on first use, so that the command line reads the settings without numpy or torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

if TYPE_CHECKING:  # what `__getattr__` gives, for type checkers and editors
    from .calibration import Calibration
    from .evaluate import (
        applicable_scores,
        evaluate_predictions,
        main_row,
        member_feature_scores,
        ood_score_names,
        ood_scores,
        summarise_ood,
    )
    from .flag_score import choose_flag_score
    from .intervals import (
        MAIN_METRICS,
        add_comparisons,
        add_intervals,
        add_score_comparisons,
        bootstrap_draws,
    )
    from .model_calibration import (
        CalibrationFit,
        calibrate,
        fit_calibration,
        fit_statistics,
        record_calibration,
        saved_calibration,
    )
    from .predict import Predictions, predict
    from .provenance import DataRecord, Provenance
    from .run import EvalData, MethodPredictions, evaluate_method, method_statistics, predict_method
    from .settings import CalibrationConfig
    from .shift import (
        IMAGE_CORRUPTIONS,
        SEVERITIES,
        TEXT_CORRUPTIONS,
        corrupt_images,
        corrupt_texts,
        shifted_sets,
    )
    from .temperature import fit_temperature
    from .uncertainty import flag_threshold, per_example

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".evaluate": (
            "applicable_scores",
            "evaluate_predictions",
            "main_row",
            "member_feature_scores",
            "ood_score_names",
            "ood_scores",
            "summarise_ood",
        ),
        ".intervals": (
            "MAIN_METRICS",
            "add_comparisons",
            "add_intervals",
            "add_score_comparisons",
            "bootstrap_draws",
        ),
        ".calibration": ("Calibration",),
        ".flag_score": ("choose_flag_score",),
        ".model_calibration": (
            "CalibrationFit",
            "calibrate",
            "fit_calibration",
            "fit_statistics",
            "record_calibration",
            "saved_calibration",
        ),
        ".predict": (
            "Predictions",
            "predict",
        ),
        ".provenance": (
            "DataRecord",
            "Provenance",
        ),
        ".run": (
            "EvalData",
            "MethodPredictions",
            "evaluate_method",
            "method_statistics",
            "predict_method",
        ),
        ".settings": ("CalibrationConfig",),
        ".shift": (
            "IMAGE_CORRUPTIONS",
            "SEVERITIES",
            "TEXT_CORRUPTIONS",
            "corrupt_images",
            "corrupt_texts",
            "shifted_sets",
        ),
        ".temperature": ("fit_temperature",),
        ".uncertainty": (
            "flag_threshold",
            "per_example",
        ),
    },
)
