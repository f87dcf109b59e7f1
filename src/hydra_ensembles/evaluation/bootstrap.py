"""Deprecated: moved to `hydra_ensembles.evaluation.intervals` (`metrics.bootstrap` holds the
resampling itself)."""

from .._moved import moved_to

__getattr__ = moved_to(__name__, "hydra_ensembles.evaluation.intervals")
