"""Members: diverse head sets from a ranking, saving and loading a member, and the wrappers that
run any set of members as one ensemble. Training is `hydra_ensembles.training`; the baselines
are `hydra_ensembles.baselines`."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .ensemble import DeepEnsemble, MCDropout, StackedMembers, as_ensemble
from .sampling import least_useful_first, member_overlap, sample_members
from .storage import AutoMember, MemberLoadError, load_member, save_member

__all__ = [
    "AutoMember",
    "DeepEnsemble",
    "MCDropout",
    "MemberLoadError",
    "StackedMembers",
    "as_ensemble",
    "least_useful_first",
    "load_member",
    "member_overlap",
    "sample_members",
    "save_member",
]

# Names that lived here before training and the baselines had modules of their own: still
# importable from here for one release, with a warning.
_MOVED = {
    **dict.fromkeys(
        (
            "CheckpointError",
            "FineTuneConfig",
            "FineTuneResult",
            "TrainingDiverged",
            "evaluate_nll",
            "fine_tune",
            "trainable_parameters",
        ),
        "hydra_ensembles.training",
    ),
    **dict.fromkeys(
        (
            "batch_ensemble",
            "batch_ensemble_members",
            "head_ensemble",
            "head_ensemble_members",
            "lora_fine_tune",
            "mimo",
            "mimo_members",
            "packed_ensemble",
            "packed_member",
            "packed_members",
            "train_head_ensemble",
            "train_mimo",
        ),
        "hydra_ensembles.baselines",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"hydra_ensembles.members.{name} is deprecated; import it from {_MOVED[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
