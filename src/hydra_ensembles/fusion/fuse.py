"""`fuse`: build one `HydraModel` from M pruned members of one base model."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..adapters import ArchitectureAdapter, get_adapter
from ..adapters.base import is_under, optional_submodule
from ..errors import InputError
from ..heads import HeadSet
from ..layers import (
    GroupedLayerNorm,
    GroupedLinear,
    MemberHeadBias,
    MemberTable,
    PerMemberModule,
)
from ..saving.metadata import read_metadata, split_metadata, write_metadata
from ..surgery import forget_calibration, kept_heads, slice_projections
from .model import FusionPolicy, HydraModel, layout_entry, member_bias_stride


class FusionError(InputError):
    """Members cannot be fused (different bases, architectures, or none at all)."""


def fuse(
    model_or_members: nn.Module | Sequence[nn.Module],
    head_sets: Sequence[HeadSet] | None = None,
    *,
    mlp: str = "merge",
    norms: str | None = None,
    classifier: str | None = None,
    embeddings: str | None = None,
    shared_trunk: bool = True,
) -> HydraModel:
    """Fuse M pruned members into one model that predicts like their ensemble in one pass.

    Two ways to name the members:

    * ``fuse(model, [hs1, hs2, hs3])``: untrained members, the base ``model`` pruned to each head
      set. They share everything but attention, so the fused model is exact in every mode.
    * ``fuse([m1, m2, m3], mlp="merge")``: members made by `prune` from one base, possibly
      fine-tuned. What they do not share is combined per part (see `FusionPolicy`): ``mlp`` for
      the MLP linears, ``norms`` for LayerNorms, ``classifier`` for pooler and classifier, and
      ``embeddings`` for the embeddings module. ``mlp="exact"`` makes every part exact (grouped
      per-member layers) so the fused model reproduces the explicit ensemble; ``mlp="merge"``
      (the paper) averages MLPs and embeddings and keeps LayerNorms and classifier per member
      (override with ``norms=``/``classifier=``/``embeddings=``).

    ``shared_trunk``: when all members keep the same heads with the same weights in the first k
    layers (and share the embeddings), those layers run once on the B input rows and only the
    later layers run on the M*B member rows (an extension beyond the paper; exact).

    The inputs are never modified; the fused model owns copies of every weight.
    """
    policy = FusionPolicy.create(mlp, norms, classifier, embeddings)
    if isinstance(model_or_members, nn.Module):
        return _fuse_untrained(model_or_members, head_sets, policy, shared_trunk)
    if head_sets is not None:
        raise TypeError("head_sets is only for fuse(model, head_sets); members carry their own heads")
    return _fuse_members(list(model_or_members), policy, shared_trunk)


def _fuse_untrained(model: nn.Module, head_sets, policy: FusionPolicy, shared_trunk: bool) -> HydraModel:
    if head_sets is None:
        raise TypeError("fuse(model, head_sets): give one HeadSet per member")
    head_sets = list(head_sets)
    _check_count(head_sets)
    for hs in head_sets:
        if not isinstance(hs, HeadSet):
            raise TypeError(f"head_sets must be HeadSet values, got {type(hs).__name__}")
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    current = kept_heads(model).resolve(original)
    targets = [hs.resolve(original) for hs in head_sets]  # validates before anything is built
    if any(len(kept) != h for kept, h in zip(current, original, strict=True)):
        raise FusionError("fuse(model, head_sets) needs an unpruned base model")

    trunk = _trunk_depth(targets, len(original)) if shared_trunk else 0
    fused_model = _clean_copy(model)
    for layer in range(len(original)):
        block = adapter.attention_block(model, layer)
        projections = [slice_projections(block, list(t[layer])) for t in targets]
        members = 1 if layer < trunk else len(targets)
        heads = [t[layer] for t in targets[:members]]
        _install(adapter, fused_model, layer, projections[:members], heads, sources=[model] * members)
    resolved = [HeadSet(dict(enumerate(t))) for t in targets]
    return HydraModel(fused_model, adapter, resolved, policy, trunk_layers=trunk)


def _fuse_members(members: list[nn.Module], policy: FusionPolicy, shared_trunk: bool) -> HydraModel:
    _check_count(members)
    for member in members:
        if not isinstance(member, nn.Module):
            raise TypeError(f"members must be models, got {type(member).__name__}")
    adapter = get_adapter(members[0])
    _check_same_base(members)
    original = adapter.original_heads_per_layer(members[0])

    targets = [kept_heads(m).resolve(original) for m in members]
    fused_model = _clean_copy(members[0])
    records = [read_metadata(m).training for m in members]
    if any(r != records[0] for r in records):  # e.g. early stopping kept another epoch per member
        write_metadata(fused_model, training={"members": records})
    all_projections = []
    for layer in range(len(original)):
        blocks = [adapter.attention_block(member, layer) for member in members]
        all_projections.append([(b.query, b.key, b.value, b.output) for b in blocks])
    layout = _combine_shared(adapter, fused_model, members, policy, len(original))
    trunk = 0
    if shared_trunk:
        trunk = _trunk_depth(targets, len(original))
        trunk = min(trunk, _same_weights_depth(adapter, all_projections, layout, trunk))
    stride = member_bias_stride(layout, original)
    for layer, projections in enumerate(all_projections):
        count = 1 if layer < trunk else len(members)
        heads = [t[layer] for t in targets[:count]]
        _install(adapter, fused_model, layer, projections[:count], heads, stride, members[:count])
    head_sets = [HeadSet(dict(enumerate(t))) for t in targets]
    return HydraModel(fused_model, adapter, head_sets, policy, layout, trunk_layers=trunk)


def _trunk_depth(targets: list, num_layers: int) -> int:
    """Leading layers where every member keeps the same heads (at most L - 1, and 0 for M = 1)."""
    if len(targets) < 2:
        return 0
    depth = 0
    while depth < num_layers - 1 and all(t[depth] == targets[0][depth] for t in targets):
        depth += 1
    return depth


def _same_weights_depth(adapter, projections: list, layout, limit: int) -> int:
    """Of the first ``limit`` layers, how many have identical attention weights across members and
    no per-member module (embeddings included)."""
    grouped = [entry["path"] for entry in layout]
    tables = tuple(p for pair in adapter.position_table_paths for p in pair if p)
    if any(is_under(p, (*adapter.input_paths, *adapter.head_bias_paths, *tables)) for p in grouped):
        return 0
    for layer in range(limit):
        root = f"{adapter.layers_path}.{layer}"
        if any(is_under(p, (root,)) for p in grouped):
            return layer
        first = projections[layer][0]
        for other in projections[layer][1:]:
            for a, b in zip(first, other, strict=True):
                if not torch.equal(a.weight, b.weight) or (
                    a.bias is not None and not torch.equal(a.bias, b.bias)
                ):
                    return layer
    return limit


def _check_count(items: list) -> None:
    if not items:
        raise FusionError("cannot fuse zero members (M = 0); give at least one")


def _check_same_base(members: list[nn.Module]) -> None:
    """All members must share architecture, configuration and (when recorded) base weights."""
    first = members[0]
    reference = _structural_config(first)
    prints = {read_metadata(m).base_fingerprint for m in members}
    for i, member in enumerate(members[1:], start=1):
        if type(member) is not type(first):
            raise FusionError(f"member {i} is a {type(member).__name__}, member 0 a {type(first).__name__}")
        if _structural_config(member) != reference:
            raise FusionError(f"member {i} has a different configuration from member 0")
    if len(prints) > 1:
        raise FusionError(
            "members come from different base models (their base fingerprints differ); "
            "make all members with he.prune from the same model"
        )


def _structural_config(model: nn.Module) -> dict[str, Any]:
    metadata, config = split_metadata(model.config.to_dict())
    # the library's metadata (heads kept, training, calibration), where it was loaded from and what
    # saving adds ("architectures", the dtype's name) are not structure; member transforms are,
    # and the weights' dtype is compared on the weights themselves
    config.update(metadata.member_transforms)
    for key in ("transformers_version", "_name_or_path", "architectures", "dtype"):
        config.pop(key, None)
    config["weights_dtype"] = str(next(model.parameters()).dtype)
    return config


def _clean_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose config no longer claims to be one pruned member (nor its calibration)."""
    copied = copy.deepcopy(model)
    write_metadata(copied, kept_heads=None, base_fingerprint=None)
    forget_calibration(copied)
    return copied


def _install(
    adapter: ArchitectureAdapter, model: nn.Module, layer: int, projections, heads, stride=0, sources=()
) -> None:
    fused = adapter.fused_attention(model, layer, projections, heads, stride, sources)
    fused.train(model.training)
    adapter.install_fused_attention(model, layer, fused)


def _combine_shared(
    adapter: ArchitectureAdapter,
    fused_model: nn.Module,
    members: list[nn.Module],
    policy: FusionPolicy,
    num_layers: int,
) -> list[dict[str, Any]]:
    """Share, merge or group every non-attention module; returns the grouped modules' layout."""
    layout: list[dict[str, Any]] = []
    skip = tuple(p for layer in range(num_layers) for p in adapter.attention_paths(layer))
    emb_path = adapter.embeddings_path
    _combine_module(fused_model, members, emb_path, policy.embeddings, layout, as_unit=True)
    replaced = _combine_position_tables(adapter, fused_model, members, policy, layout)
    for path, module in list(fused_model.named_modules()):
        if not path or is_under(path, (*skip, emb_path, *replaced)):
            continue
        if not list(module.parameters(recurse=False)):
            continue
        # score-bias tables are per head, like attention: per member whatever the policy
        bias_table = path in adapter.head_bias_paths
        mode = "exact" if bias_table else getattr(policy, adapter.part_of(path, module))
        if _combine_module(fused_model, members, path, mode, layout, as_unit=False, bias_table=bias_table):
            replaced.append(path)
    return layout


def _combine_position_tables(
    adapter: ArchitectureAdapter,
    fused_model: nn.Module,
    members: list[nn.Module],
    policy: FusionPolicy,
    layout: list[dict[str, Any]],
) -> list[str]:
    """Each position table and its norm as one unit (`ArchitectureAdapter.position_tables`): shared
    where members agree, averaged (``merge``) or kept per member as (M, rows, width) with
    per-member norms (``exact``) under the embeddings policy. Returns the paths it handled."""
    handled: list[str] = []
    for table, norm in adapter.position_table_paths:
        norm = norm if norm and optional_submodule(fused_model, norm) is not None else None
        if optional_submodule(fused_model, table) is None:  # e.g. DeBERTa without relative attention
            continue
        paths = [table] + ([norm] if norm else [])
        handled += paths
        if not any(_differ(members, path) for path in paths):
            continue
        if policy.embeddings == "merge":
            for path in paths:
                _combine_module(fused_model, members, path, "merge", layout, as_unit=False)
            continue
        peers = [[m.get_submodule(path) for m in members] for path in paths]
        member_table = MemberTable.from_embeddings(peers[0]).train(fused_model.training)
        fused_model.set_submodule(table, member_table)
        layout.append(layout_entry(table, member_table))
        if norm:
            grouped = GroupedLayerNorm.from_layer_norms(peers[1]).train(fused_model.training)
            fused_model.set_submodule(norm, grouped)
            layout.append(layout_entry(norm, grouped))
    return handled


def _differ(members: list[nn.Module], path: str) -> bool:
    """Whether the members' parameters at ``path`` differ."""
    named = [dict(m.get_submodule(path).named_parameters()) for m in members]
    return not all(all(torch.equal(n[k], named[0][k]) for k in named[0]) for n in named[1:])


def _combine_module(
    fused_model: nn.Module,
    members: list[nn.Module],
    path: str,
    mode: str,
    layout: list[dict[str, Any]],
    as_unit: bool,
    bias_table: bool = False,
) -> bool:
    """Merge or group the module at ``path`` if members differ there; True if it was replaced."""
    peers = [m.get_submodule(path) for m in members]
    recurse = as_unit
    named = [dict(p.named_parameters(recurse=recurse)) for p in peers]
    if all(all(torch.equal(n[k], named[0][k]) for k in named[0]) for n in named[1:]):
        return False
    target = fused_model.get_submodule(path)
    if mode == "merge":
        with torch.no_grad():
            for name, param in target.named_parameters(recurse=recurse):
                mean = torch.stack([n[name].float() for n in named]).mean(0)
                param.copy_(mean.to(param.dtype))
        return False
    grouped = _grouped(peers, as_unit, bias_table).train(target.training)
    fused_model.set_submodule(path, grouped)
    layout.append(layout_entry(path, grouped))
    return True


def _grouped(peers: list[nn.Module], as_unit: bool, bias_table: bool = False) -> nn.Module:
    first = peers[0]
    if bias_table:
        return MemberHeadBias.from_embeddings(peers)
    if not as_unit and type(first) is nn.Linear:
        return GroupedLinear.from_linears(peers)
    if not as_unit and type(first) is nn.LayerNorm and first.elementwise_affine:
        return GroupedLayerNorm.from_layer_norms(peers)
    return PerMemberModule([copy.deepcopy(p) for p in peers])
