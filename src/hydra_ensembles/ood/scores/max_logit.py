"""``max_logit``: minus the largest of the members' mean logits (Hendrycks et al., 2022)."""

from __future__ import annotations

from ... import metrics as M
from ..registry import LogitScore, register_logit_score


@register_logit_score
class MaxLogit(LogitScore):
    name = "max_logit"

    def score(self, view):
        return M.max_logit_score(view.mean_logits)
