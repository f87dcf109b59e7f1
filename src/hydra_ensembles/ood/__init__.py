"""Out-of-distribution detection on the features every member's classifier reads: the features
(`features`) and the scores fit on ID training data (`detectors`)."""

from .detectors import BANK_SIZE, FEATURE_SCORES, KNN_K, STATISTICS_NAME, FeatureStatistics, vim_dimension
from .features import FeatureError, FeatureTap, logits_layers, member_heads

__all__ = [
    "BANK_SIZE",
    "FEATURE_SCORES",
    "KNN_K",
    "STATISTICS_NAME",
    "FeatureError",
    "FeatureStatistics",
    "FeatureTap",
    "logits_layers",
    "member_heads",
    "vim_dimension",
]
