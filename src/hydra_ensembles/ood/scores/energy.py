"""``energy``: the free energy of the members' mean logits, sign flipped (Liu et al., 2020)."""

from __future__ import annotations

from ... import metrics as M
from ..registry import LogitScore, register_logit_score


@register_logit_score
class Energy(LogitScore):
    name = "energy"

    def score(self, view):
        return M.energy_score(view.mean_logits)
