"""Deprecated: moved to `hydra_ensembles.saving.formats` (everything saved and loaded lives in `saving`)."""

from ._moved import moved_to

__getattr__ = moved_to(__name__, "hydra_ensembles.saving.formats")
