"""``knn``: the Euclidean distance of the normalised feature to its k-th nearest normalised
training feature (Sun et al., 2022; k = 50, or the bank's size if smaller)."""

from __future__ import annotations

import numpy as np

from ..geometry import normalised, unit
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class NearestNeighbour(FeatureScore):
    name = "knn"
    passes = 1  # the bank's rows, kept where they are found

    def summarise(self, step, block, context):
        kept = np.isin(block.index, context.bank_rows)
        return {"index": block.index[kept], "rows": normalised(block.features[:, kept])}

    def merge(self, step, summaries):
        index = np.concatenate([s["index"] for s in summaries])
        rows = np.concatenate([s["rows"] for s in summaries], 1)
        return {"rows": rows[:, np.argsort(index, kind="stable")]}  # in the order of the training rows

    def finish(self, step, summary, context):
        return {"knn.bank": summary["rows"]}

    def score(self, f, tensors, context):
        similarity = unit(f) @ tensors["knn.bank"].transpose(1, 2)  # (M, N, bank)
        kth = similarity.topk(int(context.settings["knn_k"]), dim=-1).values[..., -1]
        return (2 - 2 * kth).clamp_min(0).sqrt()
