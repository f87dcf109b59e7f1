"""Deprecated: moved to `hydra_ensembles.loading` (loading knows every model kind, so it sits above
the model packages; `saving` is the floor they save with)."""

from .._moved import moved_to

__getattr__ = moved_to(__name__, "hydra_ensembles.loading")
