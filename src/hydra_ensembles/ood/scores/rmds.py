"""``rmds``: relative Mahalanobis (Ren et al., 2021): the class distance minus the distance to the
mean of all training features under their own covariance, ``min_c d_c(f) - d_0(f)``."""

from __future__ import annotations

from ..geometry import distance, min_distance
from ..passes import precisions, scatter
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class RelativeMahalanobis(FeatureScore):
    name = "rmds"
    reads = ("mds",)  # the class distance is mds's
    passes = 2  # the mean of all rows, then the covariance around it

    def summarise(self, step, block, context):
        if step == 0:
            return {"sum": block.features.sum(1)}
        return scatter(block.features - context.fitted["rmds.mean"][:, None])

    def finish(self, step, summary, context):
        n = int(context.settings["examples"])
        if step == 0:
            return {"rmds.mean": summary["sum"] / n}
        return {"rmds.precision": precisions(summary, n, "rmds")}

    def score(self, f, tensors, context):
        background = distance(f, tensors["rmds.mean"].unsqueeze(1), tensors["rmds.precision"]).squeeze(-1)
        return min_distance(f, tensors["mds.means"], tensors["mds.precision"]) - background
