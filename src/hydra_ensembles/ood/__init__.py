"""Out-of-distribution detection on the features every member's classifier reads: the features
(`features`) and the scores fit on ID training data (`detectors`)."""

from .detectors import BANK_SIZE, KNN_K, STATISTICS_NAME, FeatureStatistics, vim_dimension
from .features import FeatureError, FeatureTap, logits_layers, member_heads
from .registry import feature_scores, logit_scores

__all__ = [
    "BANK_SIZE",
    "KNN_K",
    "STATISTICS_NAME",
    "FeatureError",
    "FeatureStatistics",
    "FeatureTap",
    "feature_scores",
    "logit_scores",
    "logits_layers",
    "member_heads",
    "vim_dimension",
]
