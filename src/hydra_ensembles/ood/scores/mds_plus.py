"""``mds++``: ``mds`` on L2-normalised features (Mueller and Hein, 2025, "Mahalanobis++")."""

from __future__ import annotations

from ..geometry import class_means_and_precision, min_distance, normalised, unit
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class MahalanobisPlusPlus(FeatureScore):
    name = "mds++"

    def fit(self, x, y, classes, context):
        return class_means_and_precision(normalised(x), y, classes, "mds++")

    def score(self, f, tensors, context):
        return min_distance(unit(f), tensors["mds++.means"], tensors["mds++.precision"])
