"""Metrics: calibration (acc, NLL, Brier, ECE, aECE), OOD detection, ensemble diversity.

Inputs may be numpy arrays or torch tensors. OOD metrics take scores where higher means more
OOD (OOD is the positive class, as in OpenOOD).
"""

from .bootstrap import intervals, paired_difference, percentile_interval, resample_indices, resampled_mean
from .classification import accuracy, adaptive_ece, aurc, bootstrap_ci, brier, classification, ece, nll
from .diversity import disagreement, diversity
from .ood import (
    POSITIVE_CLASS,
    auroc,
    energy_score,
    entropy_score,
    fpr_at_tpr,
    gen_score,
    max_logit_score,
    msp_score,
    mutual_information_score,
    ood,
    resampled_ood,
)

__all__ = [
    "POSITIVE_CLASS",
    "accuracy",
    "adaptive_ece",
    "aurc",
    "auroc",
    "bootstrap_ci",
    "brier",
    "classification",
    "disagreement",
    "diversity",
    "ece",
    "energy_score",
    "entropy_score",
    "fpr_at_tpr",
    "gen_score",
    "intervals",
    "max_logit_score",
    "msp_score",
    "mutual_information_score",
    "nll",
    "ood",
    "paired_difference",
    "percentile_interval",
    "resample_indices",
    "resampled_mean",
    "resampled_ood",
]
