"""How a model is calibrated (`CalibrationConfig`): the settings and their defaults, one place
for the library and the command line (whose options default to these). Plain Python, so that the
command line states them in ``--help`` without importing the numerical libraries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

AUTO_SCORE = "auto"
"""The flag score `flag_score.choose_flag_score` picks."""
FLAG_METHODS = ("conformal", "quantile")
"""How a flag threshold is set from ID calibration scores: with the (n + 1) correction
(conformal, the default, with p-values), or as their plain ``keep`` quantile."""
SET_METHODS = ("lac", "aps", "raps")
"""Conformal prediction sets' non-conformity scores (`conformal.prediction_sets`): LAC (1 - p_y),
APS (the probability mass ranked at or above y) and RAPS (APS plus a penalty on ranks past
``k_reg``)."""


@dataclass(frozen=True)
class CalibrationConfig:
    """How a model is calibrated: the settings of `Calibration.fit`, `fit_calibration`,
    `calibrate`, ``BuildConfig.calibration`` and the commands' options, one name each.

    ``score``: the OOD score that decides the flag (`ood_score_names`, or ``"auto"``:
    `choose_flag_score`); ``keep``: the share of ID inputs left unflagged (the flag's level is
    1 - keep); ``flag_method``: ``"conformal"`` (the (n + 1)-corrected threshold, with p-values) or
    ``"quantile"``; ``set_method``: conformal prediction sets (``lac``, ``aps``, ``raps``; ``""``:
    none) at level ``set_alpha``, per class with ``set_classwise`` (Mondrian). The defaults: the
    flag score chosen (``auto``), a conformal flag keeping 95% of ID inputs, LAC sets at level
    0.1."""

    score: str = AUTO_SCORE
    keep: float = 0.95
    flag_method: str = "conformal"
    set_method: str = "lac"
    set_alpha: float = 0.1
    set_classwise: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.score, str) or not self.score:
            raise InputError(f"the flag score must be a name, got {self.score!r}")
        check_flag_settings(self.keep, self.flag_method)
        if self.set_method not in ("", *SET_METHODS):
            raise InputError(f"unknown prediction-set method {self.set_method!r}; choose from {SET_METHODS}")
        if not 0 < self.set_alpha < 1:
            raise InputError(f"set_alpha must be in (0, 1), got {self.set_alpha}")
        if not isinstance(self.set_classwise, bool):
            raise InputError(f"set_classwise must be True or False, got {self.set_classwise!r}")

    @classmethod
    def merged(cls, config: CalibrationConfig | None, settings: dict[str, Any]) -> CalibrationConfig:
        """``config`` (default ``CalibrationConfig()``) with keyword ``settings`` replacing its
        fields: what the functions taking a config and settings calibrate with."""
        if config is not None and not isinstance(config, CalibrationConfig):
            raise TypeError(f"config must be a CalibrationConfig (settings by keyword), got {config!r:.40}")
        return (config or cls()).replace(**settings)

    def replace(self, **settings: Any) -> CalibrationConfig:
        """This configuration with the named settings replaced (TypeError for an unknown name)."""
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown calibration settings {unknown}")
        return dataclasses.replace(self, **settings)


def check_flag_settings(keep: float, flag_method: str) -> None:
    """InputError for a flag level or method a calibration cannot have."""
    if not 0 < keep <= 1:
        raise InputError(f"keep must be in (0, 1], got {keep}")
    if flag_method not in FLAG_METHODS:
        raise InputError(f"unknown flag method {flag_method!r}; choose from {FLAG_METHODS}")
