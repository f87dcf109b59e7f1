"""``mds++``: ``mds`` on L2-normalised features (Mueller and Hein, 2025, "Mahalanobis++")."""

from __future__ import annotations

from ..geometry import min_distance, normalised, unit
from ..passes import class_covariance_finish, class_covariance_summary
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class MahalanobisPlusPlus(FeatureScore):
    name = "mds++"
    passes = 2

    def summarise(self, step, block, context):
        return class_covariance_summary(step, normalised(block.features), block, context, self.name)

    def finish(self, step, summary, context):
        return class_covariance_finish(step, summary, context, self.name)

    def score(self, f, tensors, context):
        return min_distance(unit(f), tensors["mds++.means"], tensors["mds++.precision"])
