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

from ..geometry import min_distance
from ..passes import class_covariance_finish, class_covariance_summary, merge_spread, spread, spread_summary
from ..registry import FeatureScore, register_feature_score

MIN_SCALE = 1e-12
"""The smallest standard deviation a standardisation divides by (a constant score has none)."""


@register_feature_score
class LayerMahalanobis(FeatureScore):
    name = "mds_layers"
    needs_layers = True
    passes = 3  # each layer's class means; its covariance; its distances' mean and spread

    def summarise(self, step, block, context):
        h = block.layers.transpose(0, 2, 1, 3)  # (M, L, n, D_h)
        if step < 2:
            return class_covariance_summary(step, h, block, context, self.name)
        fitted = {
            key: torch.from_numpy(context.fitted[key]) for key in ("mds_layers.means", "mds_layers.precision")
        }
        return spread_summary(
            layer_distances(torch.from_numpy(block.layers), fitted).permute(0, 2, 1).numpy()
        )

    def merge(self, step, summaries):
        return super().merge(step, summaries) if step < 2 else merge_spread(summaries)

    def finish(self, step, summary, context):
        if step < 2:
            return class_covariance_finish(step, summary, context, self.name)
        centre, scale = spread(summary)
        return {"mds_layers.centre": centre, "mds_layers.scale": np.maximum(scale, MIN_SCALE)}  # (M, L)

    def score(self, f, tensors, context):
        return standardised_layer_distances(context.layer_features, tensors).mean(-1)


def layer_distances(h: torch.Tensor, tensors) -> torch.Tensor:
    """Each member's distance at each layer ``d_l`` (M, N, L) from its pooled tokens after every
    layer ``h`` (M, N, L, D_h) and the class means and precision `LayerMahalanobis` fit."""
    means, precision = tensors["mds_layers.means"], tensors["mds_layers.precision"]
    return torch.stack(
        [min_distance(h[:, :, layer], means[:, layer], precision[:, layer]) for layer in range(h.shape[2])],
        -1,
    )


def standardised_layer_distances(h: torch.Tensor, tensors) -> torch.Tensor:
    """Each member's standardised distance at each layer, ``z_l`` (M, N, L), from its pooled
    tokens after every layer ``h`` (M, N, L, D_h) and the arrays `LayerMahalanobis` fit."""
    centre, scale = tensors["mds_layers.centre"][:, None], tensors["mds_layers.scale"][:, None]
    return (layer_distances(h, tensors) - centre) / scale
