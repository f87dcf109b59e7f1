"""Members: diverse head sets from a ranking, saving and loading a member, and the wrappers that
run any set of members as one ensemble. Training is `hydra_ensembles.training`; the baselines
are `hydra_ensembles.baselines`."""

from __future__ import annotations

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
