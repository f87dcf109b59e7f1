"""``mds``: the Mahalanobis distance to the closest class mean under one covariance shared by
the classes (Lee et al., 2018), ``min_c (f - mu_c)^T P (f - mu_c)``."""

from __future__ import annotations

from ..geometry import min_distance
from ..passes import class_covariance_finish, class_covariance_summary
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class Mahalanobis(FeatureScore):
    name = "mds"
    passes = 2  # the class means, then the covariance around them

    def summarise(self, step, block, context):
        return class_covariance_summary(step, block.features, block, context, self.name)

    def finish(self, step, summary, context):
        return class_covariance_finish(step, summary, context, self.name)

    def score(self, f, tensors, context):
        return min_distance(f, tensors["mds.means"], tensors["mds.precision"])
