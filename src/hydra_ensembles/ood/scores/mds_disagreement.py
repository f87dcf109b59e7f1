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

import torch

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

    def fit(self, x, y, classes, context):
        return {}  # everything it fits is across the members (fit_ensemble)

    def fit_ensemble(self, f, tensors, context):
        members, disagreement = _agreement_statistics(context.layer_features, tensors)
        ensemble = members.mean(0)
        values = torch.stack(
            [
                ensemble.mean(),
                ensemble.std(unbiased=False).clamp_min(MIN_SCALE),
                disagreement.mean(),
                disagreement.std(unbiased=False).clamp_min(MIN_SCALE),
            ]
        )  # centre and scale of each term
        # (M, 4): one row per member, as every fitted array has a leading member axis
        return {"mds_disagreement.standardise": values.expand(f.shape[0], 4).numpy().copy()}

    def score(self, f, tensors, context):
        members, disagreement = _agreement_statistics(context.layer_features, tensors)
        centre_a, scale_a, centre_s, scale_s = tensors["mds_disagreement.standardise"][0]
        return (members - centre_a) / scale_a + ((disagreement - centre_s) / scale_s)[None]
