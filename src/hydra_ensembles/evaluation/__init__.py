"""Evaluation: predictions of any model or ensemble, temperature scaling, metrics, shift."""

from .bootstrap import MAIN_METRICS, add_comparisons, add_intervals, bootstrap_draws
from .calibration import Calibration, calibrate, fit_calibration, saved_calibration
from .evaluate import OOD_SCORES, evaluate_predictions, main_row, ood_scores, summarise_ood
from .predict import Predictions, predict
from .run import EvalData, MethodPredictions, evaluate_method, predict_method
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
    "OOD_SCORES",
    "SEVERITIES",
    "TEXT_CORRUPTIONS",
    "Calibration",
    "EvalData",
    "MethodPredictions",
    "Predictions",
    "add_comparisons",
    "add_intervals",
    "bootstrap_draws",
    "calibrate",
    "corrupt_images",
    "corrupt_texts",
    "evaluate_method",
    "evaluate_predictions",
    "fit_calibration",
    "fit_temperature",
    "flag_threshold",
    "main_row",
    "ood_scores",
    "per_example",
    "predict",
    "predict_method",
    "saved_calibration",
    "shifted_sets",
    "summarise_ood",
]
