"""Evaluation: predictions of any model or ensemble, temperature scaling, metrics, shift."""

from .evaluate import OOD_SCORES, evaluate_predictions, ood_scores, summarise_ood
from .predict import Predictions, predict
from .shift import IMAGE_CORRUPTIONS, SEVERITIES, TEXT_CORRUPTIONS, corrupt_images, corrupt_texts
from .temperature import fit_temperature

__all__ = [
    "IMAGE_CORRUPTIONS",
    "OOD_SCORES",
    "SEVERITIES",
    "TEXT_CORRUPTIONS",
    "Predictions",
    "corrupt_images",
    "corrupt_texts",
    "evaluate_predictions",
    "fit_temperature",
    "ood_scores",
    "predict",
    "summarise_ood",
]
