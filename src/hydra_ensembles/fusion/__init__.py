"""Fusion: M pruned members -> one `HydraModel` (fused attention, merged or grouped MLPs)."""

from .fuse import FusionError, fuse
from .model import FusionPolicy, HydraModel, HydraOutput
from .serialization import HydraLoadError, load_hydra, save_hydra

__all__ = [
    "FusionError",
    "FusionPolicy",
    "HydraLoadError",
    "HydraModel",
    "HydraOutput",
    "fuse",
    "load_hydra",
    "save_hydra",
]
