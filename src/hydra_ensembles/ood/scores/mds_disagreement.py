"""``mds_disagreement``: every layer's view combined with how much the members disagree there.
From the standardised distances ``z_ml`` of ``mds_layers`` (member m, layer l), two statistics
of each input: the ensemble's ``mds_layers``, ``a = mean_m mean_l z_ml``, and the members'
disagreement in feature space, ``s = mean_l std_m z_ml`` (0 where the members' views of every
layer agree). Each is standardised by its mean and standard deviation over the ID training
inputs, and the score is their sum, ``(a - mean a) / sd a + (s - mean s) / sd s``: equal weights,
fit on labelled ID training data only (nothing on validation or OOD data), so its ID false-alarm
bound is the flag's (the conformal threshold on ID validation data the fit never saw).

A member's score is its own ``mean_l z_ml`` standardised the same way plus the shared
disagreement term, so that the members' mean is the score. It needs two members or more (a
single model has no disagreement) and every layer's tokens (`predict`'s ``layers``)."""

from __future__ import annotations

import numpy as np
import torch

from ..passes import merge_spread, spread, spread_summary
from ..registry import FeatureScore, register_feature_score
from .mds_layers import MIN_SCALE, standardised_layer_distances


def _agreement_statistics(h: torch.Tensor, tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's layer mean ``mean_l z_ml`` (M, N) and the members' disagreement
    ``mean_l std_m z_ml`` (N,), from every layer's tokens ``h`` (M, N, L, D_h)."""
    z = standardised_layer_distances(h, tensors)  # (M, N, L)
    return z.mean(-1), z.std(0, unbiased=False).mean(-1)


@register_feature_score
class MahalanobisDisagreement(FeatureScore):
    name = "mds_disagreement"
    reads = ("mds_layers",)
    needs_layers = True
    ensemble_only = True
    passes = 4  # after mds_layers' three: the mean and spread of both terms, across the members

    def summarise(self, step, block, context):
        if step < 3:
            return {}
        if not len(block.labels):
            return spread_summary(np.zeros((2, 0)))
        tensors = {
            key: torch.from_numpy(v) for key, v in context.fitted.items() if key.startswith("mds_layers.")
        }
        members, disagreement = _agreement_statistics(torch.from_numpy(block.layers), tensors)
        return spread_summary(torch.stack([members.mean(0), disagreement]).numpy())

    def merge(self, step, summaries):
        return {} if step < 3 else merge_spread(summaries)

    def finish(self, step, summary, context):
        if step < 3:
            return {}
        centre, scale = spread(summary)
        scale = np.maximum(scale, MIN_SCALE)
        values = np.array([centre[0], scale[0], centre[1], scale[1]])  # centre and scale of each term
        # (M, 4): one row per member, as every fitted array has a leading member axis
        return {"mds_disagreement.standardise": np.tile(values, (int(context.settings["members"]), 1))}

    def score(self, f, tensors, context):
        members, disagreement = _agreement_statistics(context.layer_features, tensors)
        centre_a, scale_a, centre_s, scale_s = tensors["mds_disagreement.standardise"][0]
        return (members - centre_a) / scale_a + ((disagreement - centre_s) / scale_s)[None]
