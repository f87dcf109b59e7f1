"""A model's calibration: its parts (the temperature, the OOD flag with the feature statistics its
score reads, the conformal prediction sets), each fit and saved on its own, and the records of
the data they were fit on (`provenance`); one fit path (`fit_calibration`) for the library and
every command; the settings and their defaults in one place (`settings`, plain Python, so that
the command line reads them without numpy or torch). The names below load with their modules on
first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

if TYPE_CHECKING:  # what `__getattr__` gives, for type checkers and editors
    from .calibration import Calibration
    from .fit import (
        CalibrationFit,
        calibrate,
        fit_calibration,
        fit_statistics,
        record_calibration,
        saved_calibration,
    )
    from .parts import Flag, PredictionSets
    from .provenance import DataRecord, Provenance
    from .settings import CalibrationConfig

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".calibration": ("Calibration",),
        ".fit": (
            "CalibrationFit",
            "calibrate",
            "fit_calibration",
            "fit_statistics",
            "record_calibration",
            "saved_calibration",
        ),
        ".parts": ("Flag", "PredictionSets"),
        ".provenance": ("DataRecord", "Provenance"),
        ".settings": ("CalibrationConfig",),
    },
)
