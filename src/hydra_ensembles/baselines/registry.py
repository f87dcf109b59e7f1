"""Member transforms: how a baseline turns a model into its members, recorded in the model's
configuration so that a saved member is rebuilt from JSON alone (`members.load_member`), run as
an ensemble (`members.as_ensemble`) and described (``hydra-ens info``).

Each baseline registers one `MemberTransform`: the configuration key its transform records, how
to rebuild the transformed architecture from that record (the weights then come from the file),
how many member-stacked outputs the model gives, and one line describing it. A new baseline is one
module that calls `register_member_transform` (docs/baselines.md shows one); loading finds every
transform registered by the modules imported so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..saving.metadata import read_metadata, register_transform_key

__all__ = [
    "MEMBER_TRANSFORMS",
    "MemberTransform",
    "rebuild_transforms",
    "register_counted",
    "register_member_transform",
    "stacked_members",
]


@dataclass(frozen=True)
class MemberTransform:
    """One baseline's transform, as the saved configuration records it."""

    name: str
    """The baseline's name, as reports and ``hydra-ens info`` give it."""
    key: str
    """The configuration attribute the transform sets (its record: a JSON value)."""
    rebuild: Callable[[nn.Module, Any], nn.Module]
    """``rebuild(model, record)``: the transformed architecture of ``model`` (weights arbitrary)."""
    describe: Callable[[Any], str]
    """One line saying what the record means."""
    members: Callable[[Any], int] = int
    """M, the member-stacked outputs of a model with this record."""
    before_pruning: bool = False
    """Rebuilt before the member's head set is pruned (where the record changes the widths the
    configuration already holds), else after."""

    def record(self, model: nn.Module) -> Any:
        """The record ``model``'s metadata holds, or None."""
        return read_metadata(model).member_transforms.get(self.key)

    def stacked_members(self, model: nn.Module) -> int:
        """M for a model this transform made, 1 for any other model."""
        record = self.record(model)
        return int(self.members(record)) if record else 1


MEMBER_TRANSFORMS: dict[str, MemberTransform] = {}
"""Every registered transform by its configuration key, in the order they were registered (the
order in which a member's transforms are rebuilt)."""


def register_member_transform(transform: MemberTransform) -> MemberTransform:
    """Add ``transform`` to `MEMBER_TRANSFORMS`; refuses a key another transform records (a
    ValueError, as `saving.formats.register_saved_format`: a conflict between two modules' code,
    not a user's input)."""
    existing = MEMBER_TRANSFORMS.get(transform.key)
    if existing is not None and existing.name != transform.name:
        raise ValueError(f"the configuration key {transform.key!r} is recorded by {existing.name} already")
    register_transform_key(transform.key)
    MEMBER_TRANSFORMS[transform.key] = transform
    return transform


def register_counted(
    name: str, key: str, build: Callable[[nn.Module, int], nn.Module], describe: str
) -> MemberTransform:
    """Register a transform whose record is its member count M: rebuilt as ``build(model, M)``,
    described by ``describe`` with ``{members}`` filled in."""
    return register_member_transform(
        MemberTransform(
            name,
            key,
            rebuild=lambda model, members: build(model, int(members)),
            describe=lambda members: describe.format(members=members),
        )
    )


def stacked_members(model: nn.Module) -> int:
    """M for a model that answers with member-stacked logits (BatchEnsemble, an ensemble of task
    heads, a Packed-Ensemble, a MIMO model, any registered transform), 1 for any other model."""
    return max((t.stacked_members(model) for t in MEMBER_TRANSFORMS.values()), default=1)


def rebuild_transforms(model: nn.Module, records: dict[str, Any], before_pruning: bool) -> nn.Module:
    """``model`` with the architecture of every transform in ``records`` (key -> record) that
    is rebuilt at this point (before or after pruning), in registration order."""
    for key, transform in MEMBER_TRANSFORMS.items():
        if transform.before_pruning == before_pruning and records.get(key):
            model = transform.rebuild(model, records[key])
    return model
