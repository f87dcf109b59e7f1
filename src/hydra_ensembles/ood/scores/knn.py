"""``knn``: the Euclidean distance of the normalised feature to its k-th nearest normalised
training feature (Sun et al., 2022; k = 50, or the bank's size if smaller)."""

from __future__ import annotations

from ..geometry import normalised, unit
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class NearestNeighbour(FeatureScore):
    name = "knn"

    def fit(self, x, y, classes, context):
        return {"knn.bank": normalised(x[context.bank_rows])}

    def score(self, f, tensors, context):
        similarity = unit(f) @ tensors["knn.bank"].transpose(1, 2)  # (M, N, bank)
        kth = similarity.topk(int(context.settings["knn_k"]), dim=-1).values[..., -1]
        return (2 - 2 * kth).clamp_min(0).sqrt()
