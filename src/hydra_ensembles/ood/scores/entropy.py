"""``entropy``: the entropy (nats) of the ensemble's probabilities."""

from __future__ import annotations

from ... import metrics as M
from ..registry import LogitScore, register_logit_score


@register_logit_score
class Entropy(LogitScore):
    name = "entropy"

    def score(self, view):
        return M.entropy_score(view.probs)
