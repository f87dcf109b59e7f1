"""hydra-ensembles: uncertainty-aware, efficient ensembles from one pretrained transformer.

Prune attention heads in M different ways, optionally fine-tune each pruned member, and fuse the
members into one model that predicts like their ensemble in a single forward pass.
"""

from . import layers, metrics
from ._version import __version__
from .adapters import UnsupportedModelError, get_adapter, register_adapter
from .build import Build, BuildConfig, build_hydra
from .configuration import after_import, on_first_config, register_config
from .errors import InputError
from .fusion import (
    FusionError,
    FusionPolicy,
    HydraLoadError,
    HydraModel,
    fuse,
    load_hydra,
)
from .heads import HeadSet, HeadSetError
from .members import AutoMember, MemberLoadError, load_member, member_overlap, sample_members, save_member
from .outputs import EnsembleOutput
from .scoring import CircuitConfig, CircuitOrder, extract_circuit, taylor_head_set, taylor_scores
from .surgery import HeadAblation, ablate, kept_heads, prune


def _register_serving() -> None:
    from . import serving  # noqa: F401  (registers the Auto model classes and pipeline tasks)


register_config()  # saved models load with AutoConfig / AutoModel... and serve through pipeline
on_first_config(_register_serving)
# the pipeline tasks exist once transformers' pipelines load, for plain classifiers too
after_import("transformers.pipelines", _register_serving)

__all__ = [
    "AutoMember",
    "Build",
    "BuildConfig",
    "CircuitConfig",
    "CircuitOrder",
    "EnsembleOutput",
    "FusionError",
    "FusionPolicy",
    "HeadAblation",
    "HeadSet",
    "HeadSetError",
    "HydraLoadError",
    "HydraModel",
    "InputError",
    "MemberLoadError",
    "UnsupportedModelError",
    "__version__",
    "ablate",
    "build_hydra",
    "extract_circuit",
    "fuse",
    "get_adapter",
    "kept_heads",
    "layers",
    "load_hydra",
    "load_member",
    "member_overlap",
    "metrics",
    "prune",
    "register_adapter",
    "sample_members",
    "save_member",
    "taylor_head_set",
    "taylor_scores",
]
