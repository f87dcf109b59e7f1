"""Evaluation: predictions of any model or ensemble, temperature scaling, metrics, shift."""

from .calibration import Calibration, CalibrationConfig, choose_flag_score
from .evaluate import (
    applicable_scores,
    evaluate_predictions,
    main_row,
    member_feature_scores,
    ood_score_names,
    ood_scores,
    summarise_ood,
)
from .intervals import MAIN_METRICS, add_comparisons, add_intervals, add_score_comparisons, bootstrap_draws
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

__all__ = [
    "IMAGE_CORRUPTIONS",
    "MAIN_METRICS",
    "SEVERITIES",
    "TEXT_CORRUPTIONS",
    "Calibration",
    "CalibrationConfig",
    "CalibrationFit",
    "DataRecord",
    "EvalData",
    "MethodPredictions",
    "Predictions",
    "Provenance",
    "add_comparisons",
    "add_intervals",
    "add_score_comparisons",
    "applicable_scores",
    "bootstrap_draws",
    "calibrate",
    "choose_flag_score",
    "corrupt_images",
    "corrupt_texts",
    "evaluate_method",
    "evaluate_predictions",
    "fit_calibration",
    "fit_statistics",
    "fit_temperature",
    "flag_threshold",
    "main_row",
    "member_feature_scores",
    "method_statistics",
    "ood_score_names",
    "ood_scores",
    "per_example",
    "predict",
    "predict_method",
    "record_calibration",
    "saved_calibration",
    "shifted_sets",
    "summarise_ood",
]
