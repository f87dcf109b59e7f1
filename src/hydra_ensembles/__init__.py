"""hydra-ensembles: uncertainty-aware, efficient ensembles from one pretrained transformer.

Prune attention heads in M different ways, optionally fine-tune each pruned member, and fuse the
members into one model that predicts like their ensemble in a single forward pass.

The public names load with their modules on first use (``import hydra_ensembles`` imports neither
torch nor transformers), so that the command line starts at once and a program pays only for what
it uses. Saved models stay loadable with transformers' Auto classes and ``pipeline``: the library's
configuration is registered when transformers' Auto configuration loads.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from ._imports import after_import, lazy_exports, on_first_use
from ._version import __version__

if TYPE_CHECKING:  # what `__getattr__` gives, for type checkers and editors
    from . import layers, metrics
    from .adapters import UnsupportedModelError, get_adapter, register_adapter
    from .build import Build, BuildConfig, build_hydra
    from .errors import InputError
    from .fusion import FusionError, FusionPolicy, HydraLoadError, HydraModel, fuse, load_hydra
    from .heads import HeadSet, HeadSetError
    from .members import AutoMember, MemberLoadError, load_member, member_overlap, sample_members, save_member
    from .outputs import EnsembleOutput
    from .scoring import CircuitConfig, CircuitOrder, extract_circuit, taylor_head_set, taylor_scores
    from .surgery import HeadAblation, ablate, kept_heads, prune

__getattr__, __dir__, _public = lazy_exports(
    __name__,
    {
        ".adapters": ("UnsupportedModelError", "get_adapter", "register_adapter"),
        ".build": ("Build", "BuildConfig", "build_hydra"),
        ".errors": ("InputError",),
        ".fusion": ("FusionError", "FusionPolicy", "HydraLoadError", "HydraModel", "fuse", "load_hydra"),
        ".heads": ("HeadSet", "HeadSetError"),
        ".members": (
            "AutoMember",
            "MemberLoadError",
            "load_member",
            "member_overlap",
            "sample_members",
            "save_member",
        ),
        ".outputs": ("EnsembleOutput",),
        ".scoring": ("CircuitConfig", "CircuitOrder", "extract_circuit", "taylor_head_set", "taylor_scores"),
        ".surgery": ("HeadAblation", "ablate", "kept_heads", "prune"),
    },
    submodules=("layers", "metrics"),
)


def _register_config() -> None:
    """Register the configuration with AutoConfig (`configuration` does on import; where it is
    being imported, which imports transformers' Auto configuration, it will at its end)."""
    if f"{__name__}.configuration" not in sys.modules:
        importlib.import_module(".configuration", __name__)


def _register_serving() -> None:
    from . import serving  # (its import registers the Auto model classes and pipeline tasks)


# saved models load with AutoConfig / AutoModel... and serve through pipeline
after_import("transformers.models.auto.configuration_auto", _register_config)
on_first_use(f"{__name__}.configuration.HydraConfig", _register_serving)
# the pipeline tasks exist once transformers' pipelines load, for plain classifiers too
after_import("transformers.pipelines", _register_serving)

__all__ = [*_public, "__version__"]
