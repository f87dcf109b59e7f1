"""Deprecated: moved to `hydra_ensembles.zero_shot` (one spelling, as the command's)."""

from ._moved import moved_to

__getattr__ = moved_to(__name__, "hydra_ensembles.zero_shot")
