"""``mds_layers``: the Mahalanobis score at every layer, combined. For each member and each
transformer layer l, ``mds`` on the layer's pooled token h_l (the [CLS]/class token; a decoder's
last real token): ``d_l = min_c (h_l - mu_lc)^T P_l (h_l - mu_lc)``, standardised by its mean and
standard deviation over the ID training features (``z_l = (d_l - m_l) / s_l``), and averaged over
the layers: ``mean_l z_l``. Everything is fit on the labelled ID training data; nothing is fit on
OOD data. An ensemble's score is, as for every feature score, the mean over its members, so the
M x L views of a fused pass all enter it. Its ID false-alarm bound is the flag's: the threshold
is a conformal quantile of this score on ID validation data the fit never saw
(`evaluation.conformal`)."""

from __future__ import annotations

import numpy as np
import torch

from ..geometry import class_means_and_precision, min_distance
from ..registry import FeatureScore, register_feature_score

MIN_SCALE = 1e-12
"""The smallest standard deviation a standardisation divides by (a constant score has none)."""


@register_feature_score
class LayerMahalanobis(FeatureScore):
    name = "mds_layers"
    needs_layers = True

    def fit(self, x, y, classes, context):
        layers = context.layers  # (N, L, D_h)
        means, precisions, centres, scales = [], [], [], []
        for layer in range(layers.shape[1]):
            h = layers[:, layer]
            fitted = class_means_and_precision(h, y, classes, "mds_layers")
            mu, precision = fitted["mds_layers.means"], fitted["mds_layers.precision"]
            d = min_distance(
                torch.from_numpy(h)[None], torch.from_numpy(mu)[None], torch.from_numpy(precision)[None]
            )
            d = d[0].numpy()
            means.append(mu)
            precisions.append(precision)
            centres.append(d.mean())
            scales.append(max(float(d.std()), MIN_SCALE))
        return {
            "mds_layers.means": np.stack(means),  # (L, K, D_h)
            "mds_layers.precision": np.stack(precisions),  # (L, D_h, D_h)
            "mds_layers.centre": np.asarray(centres),  # (L,)
            "mds_layers.scale": np.asarray(scales),  # (L,)
        }

    def score(self, f, tensors, context):
        return standardised_layer_distances(context.layer_features, tensors).mean(-1)


def standardised_layer_distances(h: torch.Tensor, tensors) -> torch.Tensor:
    """Each member's standardised distance at each layer, ``z_l`` (M, N, L), from its pooled
    tokens after every layer ``h`` (M, N, L, D_h) and the arrays `LayerMahalanobis` fit."""
    means, precision = tensors["mds_layers.means"], tensors["mds_layers.precision"]
    per_layer = torch.stack(
        [min_distance(h[:, :, layer], means[:, layer], precision[:, layer]) for layer in range(h.shape[2])],
        -1,
    )  # (M, N, L)
    centre, scale = tensors["mds_layers.centre"][:, None], tensors["mds_layers.scale"][:, None]
    return (per_layer - centre) / scale
