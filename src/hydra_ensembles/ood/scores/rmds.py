"""``rmds``: relative Mahalanobis (Ren et al., 2021): the class distance minus the distance to the
mean of all training features under their own covariance, ``min_c d_c(f) - d_0(f)``."""

from __future__ import annotations

from ..geometry import distance, min_distance, precision_matrix
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class RelativeMahalanobis(FeatureScore):
    name = "rmds"
    reads = ("mds",)  # the class distance is mds's

    def fit(self, x, y, classes, context):
        return {"rmds.mean": x.mean(0), "rmds.precision": precision_matrix(x - x.mean(0), "rmds")}

    def score(self, f, tensors, context):
        background = distance(f, tensors["rmds.mean"].unsqueeze(1), tensors["rmds.precision"]).squeeze(-1)
        return min_distance(f, tensors["mds.means"], tensors["mds.precision"]) - background
