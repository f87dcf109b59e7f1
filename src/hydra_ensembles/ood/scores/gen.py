"""``gen``: generalised entropy of the ensemble's probabilities (Liu et al., 2023), the authors'
gamma = 0.1 over the 100 largest probabilities."""

from __future__ import annotations

from ... import metrics as M
from ..registry import LogitScore, register_logit_score


@register_logit_score
class GeneralisedEntropy(LogitScore):
    name = "gen"

    def score(self, view):
        return M.gen_score(view.probs)
