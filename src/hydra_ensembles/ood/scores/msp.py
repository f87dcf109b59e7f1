"""``msp``: one minus the ensemble's largest class probability (Hendrycks and Gimpel, 2017)."""

from __future__ import annotations

from ... import metrics as M
from ..registry import LogitScore, register_logit_score


@register_logit_score
class MaxSoftmaxProbability(LogitScore):
    name = "msp"

    def score(self, view):
        return M.msp_score(view.probs)
