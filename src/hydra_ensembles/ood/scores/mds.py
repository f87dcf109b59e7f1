"""``mds``: the Mahalanobis distance to the closest class mean under one covariance shared by
the classes (Lee et al., 2018), ``min_c (f - mu_c)^T P (f - mu_c)``."""

from __future__ import annotations

from ..geometry import class_means_and_precision, min_distance
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class Mahalanobis(FeatureScore):
    name = "mds"

    def fit(self, x, y, classes, context):
        return class_means_and_precision(x, y, classes, "mds")

    def score(self, f, tensors, context):
        return min_distance(f, tensors["mds.means"], tensors["mds.precision"])
