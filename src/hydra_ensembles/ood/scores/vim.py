"""``vim``: virtual-logit matching (Wang et al., 2022): ``alpha * ||(f - o) R|| - logsumexp(logits)``
with ``o = -pinv(W) b`` the origin the output layer maps to zero logits, ``R`` the directions of
the (uncentred, around ``o``) training covariance outside its ``k`` principal ones (`vim_dimension`),
and ``alpha`` the training mean of the largest logit over the mean residual norm."""

from __future__ import annotations

import numpy as np
import torch

from ...errors import InputError
from ..geometry import vim_dimension
from ..registry import FeatureScore, register_feature_score


@register_feature_score
class VirtualLogit(FeatureScore):
    name = "vim"
    needs_head = True

    def can_fit(self, examples, width):
        return examples > vim_dimension(width)  # else the features lie inside the principal subspace

    def fit(self, x, y, classes, context):
        weight, bias = context.head
        origin = -np.linalg.pinv(weight) @ bias
        centred = x - origin
        values, vectors = np.linalg.eigh(centred.T @ centred / len(x))
        basis = vectors[:, np.argsort(-values)[vim_dimension(x.shape[1]) :]]  # outside the principal subspace
        residual = np.linalg.norm(centred @ basis, axis=-1).mean()
        largest = (x @ weight.T + bias).max(-1).mean()
        alpha = np.asarray(largest / residual if residual > 0 else 0.0)
        return {"vim.origin": origin, "vim.basis": basis, "vim.alpha": alpha}

    def score(self, f, tensors, context):
        if context.member_logits is None:
            raise InputError("ViM reads the members' logits as well as their features")
        logits = context.member_logits.to(device=f.device, dtype=torch.float64)
        residual = torch.linalg.vector_norm(
            (f - tensors["vim.origin"].unsqueeze(1)) @ tensors["vim.basis"], dim=-1
        )
        return tensors["vim.alpha"].unsqueeze(1) * residual - torch.logsumexp(logits, -1)
