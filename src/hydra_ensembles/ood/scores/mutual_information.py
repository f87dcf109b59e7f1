"""``mutual_information``: the members' disagreement, the entropy of the ensemble's probabilities
minus the members' mean entropy (an ensemble's score: a single model has none)."""

from __future__ import annotations

from ... import metrics as M
from ...errors import InputError
from ..registry import LogitScore, register_logit_score


@register_logit_score
class MutualInformation(LogitScore):
    name = "mutual_information"
    ensemble_only = True

    def score(self, view):
        if view.member_probs.shape[0] < 2:
            raise InputError("mutual information measures members' disagreement: it needs an ensemble")
        return M.mutual_information_score(view.member_probs)
