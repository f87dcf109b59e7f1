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
    passes = 3  # the origin; the principal space around it; the residual and largest logit's means

    def can_fit(self, examples, width):
        return examples > vim_dimension(width)  # else the features lie inside the principal subspace

    def summarise(self, step, block, context):
        if step == 0:
            return {}
        centred = block.features - context.fitted["vim.origin"][:, None]
        if step == 1:
            return {"scatter": centred.transpose(0, 2, 1) @ centred}
        weight, bias = context.heads
        logits = block.features @ weight.transpose(0, 2, 1) + bias[:, None]
        residual = np.linalg.norm(centred @ context.fitted["vim.basis"], axis=-1)
        return {"residual": residual.sum(1), "largest": logits.max(-1).sum(1)}

    def finish(self, step, summary, context):
        n = int(context.settings["examples"])
        if step == 0:
            weight, bias = context.heads
            return {
                "vim.origin": np.stack([-np.linalg.pinv(w) @ b for w, b in zip(weight, bias, strict=True)])
            }
        if step == 1:
            bases = []
            for covariance in summary["scatter"] / n:
                values, vectors = np.linalg.eigh(covariance)
                bases.append(vectors[:, np.argsort(-values)[int(context.settings["vim_dim"]) :]])
            return {"vim.basis": np.stack(bases)}  # outside the principal subspace
        residual, largest = summary["residual"] / n, summary["largest"] / n
        alpha = np.where(residual > 0, largest / np.where(residual > 0, residual, 1), 0.0)
        return {"vim.alpha": alpha}

    def score(self, f, tensors, context):
        if context.member_logits is None:
            raise InputError("ViM reads the members' logits as well as their features")
        logits = context.member_logits.to(device=f.device, dtype=torch.float64)
        residual = torch.linalg.vector_norm(
            (f - tensors["vim.origin"].unsqueeze(1)) @ tensors["vim.basis"], dim=-1
        )
        return tensors["vim.alpha"].unsqueeze(1) * residual - torch.logsumexp(logits, -1)
