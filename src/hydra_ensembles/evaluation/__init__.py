"""Evaluation: predictions of any model or ensemble, OOD scores, temperature scaling, conformal
flags and sets, metrics with intervals, and shift (a model's calibration, fit from these parts,
is `hydra_ensembles.calibration`). The names below load with their modules on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

if TYPE_CHECKING:  # what `__getattr__` gives, for type checkers and editors
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
    from .predict import Predictions, predict
    from .run import EvalData, MethodPredictions, evaluate_method, method_statistics, predict_method
    from .shift import (
        IMAGE_CORRUPTIONS,
        SEVERITIES,
        TEXT_CORRUPTIONS,
        corrupt_images,
        corrupt_texts,
        shifted_sets,
    )
    from .temperature import fit_temperature, split_for_sets
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
        ".flag_score": ("choose_flag_score",),
        ".predict": (
            "Predictions",
            "predict",
        ),
        ".run": (
            "EvalData",
            "MethodPredictions",
            "evaluate_method",
            "method_statistics",
            "predict_method",
        ),
        ".shift": (
            "IMAGE_CORRUPTIONS",
            "SEVERITIES",
            "TEXT_CORRUPTIONS",
            "corrupt_images",
            "corrupt_texts",
            "shifted_sets",
        ),
        ".temperature": ("fit_temperature", "split_for_sets"),
        ".uncertainty": (
            "flag_threshold",
            "per_example",
        ),
    },
)
