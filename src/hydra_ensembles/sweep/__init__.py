"""Sweeps: many configurations built, calibrated and measured on the user's own data, their
cost/quality frontier, and the best one within a latency budget (``hydra-ens sweep``)."""

from .frontier import choose, frontier, quality_key, significance, verdict
from .grid import SINGLE, Candidate, SweepConfig
from .run import CHOSEN, CONFIGS, SweepData, SweepResult, check_sweep, model_folder, run_sweep

__all__ = [
    "CHOSEN",
    "CONFIGS",
    "SINGLE",
    "Candidate",
    "SweepConfig",
    "SweepData",
    "SweepResult",
    "check_sweep",
    "choose",
    "frontier",
    "model_folder",
    "quality_key",
    "run_sweep",
    "significance",
    "verdict",
]
