"""The flag score a calibration ships, chosen on validation data by the rule of docs/ood.md: the
score that best separates the ID validation inputs from the OOD validation inputs (AUROC), where
they separate beyond chance; otherwise `DEFAULT_FEATURE_SCORE` where feature statistics were fit,
else ``msp``."""

from __future__ import annotations

import math
import warnings

import numpy as np

from .. import metrics as M
from ..errors import InputError
from ..ood.detectors import FeatureStatistics
from .evaluate import applicable_scores, ood_scores
from .predict import Predictions

DEFAULT_FEATURE_SCORE = "mds"
"""The flag score where feature statistics were fit and no OOD validation data was given."""


def choose_flag_score(
    id_validation: Predictions,
    statistics: FeatureStatistics | None = None,
    ood_validation: Predictions | None = None,
    temperature: float | np.ndarray = 1.0,
) -> str:
    """The flag score, by the rule of docs/ood.md: with OOD validation predictions, the score
    (among those the predictions and statistics allow) with the highest AUROC of ID validation
    against OOD validation, the earlier in `ood_score_names` on a tie; without, `DEFAULT_FEATURE_SCORE`
    where feature statistics were fit, else ``msp``. OOD validation data that no score separates
    from the ID validation data beyond chance (every AUROC within two null standard errors of
    0.5) chooses nothing: the rule without OOD data applies, with a warning saying so. Never give
    it an OOD test set."""
    usable = applicable_scores(id_validation, statistics)
    default = DEFAULT_FEATURE_SCORE if DEFAULT_FEATURE_SCORE in usable else "msp"
    if ood_validation is None:
        return default
    aurocs = validation_aurocs(id_validation, ood_validation, statistics, temperature)
    order = list(aurocs)
    best = max(order, key=lambda s: (aurocs[s], -order.index(s)))
    n_id, n_ood = id_validation.member_logits.shape[1], ood_validation.member_logits.shape[1]
    chance = 0.5 + 2 * math.sqrt((n_id + n_ood + 1) / (12 * n_id * n_ood))  # AUROC's null sd (Mann-Whitney)
    if aurocs[best] <= chance:
        warnings.warn(
            f"the OOD validation data separates no score from the ID validation data beyond chance (best "
            f"AUROC {aurocs[best]:.3f}, by {best}; chance reaches {chance:.3f} at these sizes): the flag "
            f"score is {default}, as without OOD data; give OOD validation data unlike the ID data",
            stacklevel=2,
        )
        return default
    return best


def validation_aurocs(
    id_validation: Predictions,
    ood_validation: Predictions,
    statistics: FeatureStatistics | None = None,
    temperature: float | np.ndarray = 1.0,
) -> dict[str, float]:
    """The AUROC of ID validation against OOD validation of every score both allow (what
    `choose_flag_score` chooses by), in the order of `ood_score_names`."""
    ood_shape, id_shape = ood_validation.member_logits.shape, id_validation.member_logits.shape
    if ood_shape[::2] != id_shape[::2]:
        raise InputError(
            f"the OOD validation predictions (members, inputs, classes) {ood_shape} are not of the "
            f"model of the ID ones {id_shape}: predict both with one model"
        )
    usable = applicable_scores(id_validation, statistics)
    usable = [s for s in usable if s in applicable_scores(ood_validation, statistics)]
    return {
        s: M.auroc(
            ood_scores(id_validation, s, temperature, statistics),
            ood_scores(ood_validation, s, temperature, statistics),
        )
        for s in usable
    }
