"""Fusion: M pruned members -> one `HydraModel` (fused attention, merged or grouped MLPs)."""

from .fuse import FusionError, fuse
from .model import FusionPolicy, HydraLoadError, HydraModel, load_hydra, save_hydra

__all__ = [
    "FusionError",
    "FusionPolicy",
    "HydraLoadError",
    "HydraModel",
    "fuse",
    "load_hydra",
    "save_hydra",
]
