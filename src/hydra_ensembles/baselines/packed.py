"""Packed-Ensembles (Laurent et al., 2023): M narrow members side by side in one wide model.

`packed_ensemble(model, M, alpha, gamma)` builds a model of the same Hugging Face class whose
widths (hidden size, MLP width, head count) are ``alpha`` times the base model's; member m owns
channel block m of every hidden state (width ``alpha*d/M``, ``alpha*H/M`` heads of the base's
head size). Every linear layer is a `PackedLinear` (``M*gamma`` diagonal blocks in the
embeddings and layers, M in the task head) and every LayerNorm a `PackedLayerNorm` (per member),
so the members never read each other's channels: the packed model computes exactly what M
independent narrow models compute (`packed_member` extracts one; the tests check it). The
task head answers with M*C logits, returned member-stacked (M*B rows, member m in rows
m*B .. (m+1)*B - 1) like BatchEnsemble, so `fine_tune` and `predict` treat it as any ensemble.

Starting weights. A member of width ``alpha*d/M`` < d cannot hold the pretrained weights, so by
default the model starts from the family's random initialisation and is trained from scratch, as
the paper trains it (pre-trained on ImageNet-21k, then fine-tuned: a budget we cannot spend
here). With ``alpha == M`` and ``gamma == 1`` each member is as wide as the base model, and
``from_base=True`` starts every member from the base model's weights (the task head from its own
random initialisation, a different one per member): Laurent et al. note that this setting is a
deep ensemble, here trained in one pass on shared batches.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..batching import StackMemberLogits
from ..errors import InputError
from ..layers.packed import PackedLayerNorm, PackedLinear
from ..saving.metadata import write_metadata
from .head_ensemble import initialise_like
from .registry import MemberTransform, register_member_transform

PACKED_KEY = "hydra_packed_ensemble"
"""Config attribute recording ``{"members", "alpha", "gamma"}`` (saved with the model)."""
PACKED = register_member_transform(
    MemberTransform(
        "Packed-Ensemble",
        PACKED_KEY,
        rebuild=lambda model, p: pack_layers(model, int(p["members"]), int(p["alpha"]), int(p["gamma"])),
        describe="Packed-Ensemble: {members} members, alpha {alpha}, gamma {gamma}".format_map,
        members=lambda packing: int(packing["members"]),
        before_pruning=True,  # the saved configuration holds the packed widths already
    )
)

WIDTH_FIELDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "bert": ("hidden_size", "num_attention_heads", ("intermediate_size",)),
    "roberta": ("hidden_size", "num_attention_heads", ("intermediate_size",)),
    "electra": ("hidden_size", "num_attention_heads", ("intermediate_size", "embedding_size")),
    "distilbert": ("dim", "n_heads", ("hidden_dim",)),
    "vit": ("hidden_size", "num_attention_heads", ("intermediate_size",)),
    "deit": ("hidden_size", "num_attention_heads", ("intermediate_size",)),
    "dinov2": ("hidden_size", "num_attention_heads", ()),  # the MLP width follows mlp_ratio
}
"""Per family, the config fields that scale with a packed model's width: (hidden size, head
count, other widths)."""


def packed_ensemble(
    model: nn.Module,
    num_members: int = 3,
    alpha: int = 2,
    gamma: int = 1,
    from_base: bool = False,
    seed: int = 0,
) -> nn.Module:
    """A Packed-Ensemble of ``model``'s architecture (see the module docstring); ``model`` is not
    modified. ``from_base`` needs ``alpha == num_members`` and ``gamma == 1``."""
    if num_members < 1 or alpha < 1 or gamma < 1:
        raise InputError(f"members, alpha and gamma must be positive, got {num_members}, {alpha}, {gamma}")
    if packed_members(model) > 1:
        raise InputError("the model is a Packed-Ensemble already")
    if from_base and (alpha != num_members or gamma != 1):
        raise InputError(
            f"from_base needs members as wide as the base model (alpha == M and gamma == 1), "
            f"got M={num_members}, alpha={alpha}, gamma={gamma}"
        )
    config = copy.deepcopy(model.config)
    for name in _width_fields(config):
        setattr(config, name, getattr(config, name) * alpha)
    _check_divisible(config, num_members, gamma)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        packed = type(model)(config)
    packed = pack_layers(packed, num_members, alpha, gamma)
    if from_base:
        _start_from(packed, model, num_members)
    first = next(model.parameters())
    return packed.to(first.device, first.dtype).eval()


def pack_layers(model: nn.Module, num_members: int, alpha: int, gamma: int) -> nn.Module:
    """Swap a (widened) model's linear layers and LayerNorms for their packed forms, in place,
    and record the packing in its config (also how `load_member` rebuilds the architecture)."""
    adapter = get_adapter(model)
    width = getattr(model.config, _width_fields(model.config)[0])
    labels = int(model.config.num_labels)
    for path, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            in_head = is_under(path, adapter.head_paths)
            if in_head and module.out_features == labels:  # a member's classifier: C -> M*C outputs
                dense = nn.Linear(module.in_features, num_members * labels, bias=module.bias is not None)
                dense.to(module.weight.device, module.weight.dtype)
                initialise_like(model, dense)
                module = dense
            groups = num_members if in_head else num_members * gamma
            chunks = max(1, module.in_features // width) if in_head else 1
            model.set_submodule(path, PackedLinear.from_linear(module, groups, chunks))
        elif isinstance(module, nn.LayerNorm):
            model.set_submodule(path, PackedLayerNorm.from_layer_norm(module, num_members))
    write_metadata(
        model, member_transforms={PACKED_KEY: {"members": num_members, "alpha": alpha, "gamma": gamma}}
    )
    model.register_forward_hook(StackMemberLogits(num_members, labels))
    return model


def packed_members(model: nn.Module) -> int:
    """M for a model made by `packed_ensemble`, 1 for any other model."""
    return PACKED.stacked_members(model)


def packed_member(model: nn.Module, member: int) -> nn.Module:
    """Member ``member`` of a Packed-Ensemble as a standalone model of the same class (width
    ``alpha*d/M``; with ``gamma`` > 1 its linear weights are zero off their gamma blocks)."""
    members = packed_members(model)
    if members == 1:
        raise InputError("not a Packed-Ensemble: make one with packed_ensemble first")
    if not 0 <= member < members:
        raise InputError(f"member {member} out of range: the ensemble has {members}")
    config = copy.deepcopy(model.config)
    write_metadata(config, member_transforms={PACKED_KEY: None})
    for name in _width_fields(config):
        setattr(config, name, getattr(config, name) // members)
    single = type(model)(config)
    packed, sources = dict(model.named_modules()), model.state_dict()
    state = {}
    for name, target in single.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        layer = packed.get(owner)
        if isinstance(layer, PackedLinear):
            state[name] = _member_block(layer, leaf, member, members)
        else:
            state[name] = _split(sources[name], target.shape, members)[member]
    single.load_state_dict(state)
    first = next(model.parameters())
    return single.to(first.device, first.dtype).eval()


def _width_fields(config) -> tuple[str, ...]:
    """All the fields of `WIDTH_FIELDS` for ``config``'s family, hidden size first."""
    fields = WIDTH_FIELDS.get(getattr(config, "model_type", ""))
    if fields is None:
        raise InputError(
            f"Packed-Ensembles support the families {sorted(WIDTH_FIELDS)}, "
            f"not {getattr(config, 'model_type', type(config).__name__)!r}"
        )
    hidden, heads, others = fields
    return (hidden, heads, *others)


def _check_divisible(config, members: int, gamma: int) -> None:
    """Every member's block must hold whole heads, and every layer split into M*gamma groups."""
    hidden, heads, *others = (getattr(config, f) for f in _width_fields(config))
    if heads % members:
        raise InputError(f"{heads} heads cannot be shared by {members} members (alpha*H % M != 0)")
    widths = [hidden, *others]
    if getattr(config, "model_type", "") == "dinov2":
        widths.append(int(hidden * config.mlp_ratio))
    for width in widths:
        if width % (members * gamma):
            raise InputError(f"width {width} cannot be split into M*gamma = {members * gamma} groups")


def _split(tensor: torch.Tensor, member_shape: torch.Size, members: int) -> list[torch.Tensor]:
    """``tensor`` cut into M member pieces along the one dimension that is M times wider (or M
    references to it where no dimension is: buffers like position ids)."""
    scaled = [i for i, (a, b) in enumerate(zip(tensor.shape, member_shape, strict=True)) if a != b]
    if not scaled:
        return [tensor] * members
    if len(scaled) > 1 or tensor.shape[scaled[0]] != members * member_shape[scaled[0]]:
        raise InputError(f"cannot split a {tuple(tensor.shape)} tensor into members of {tuple(member_shape)}")
    return list(tensor.chunk(members, dim=scaled[0]))


def _member_block(layer: PackedLinear, leaf: str, member: int, members: int) -> torch.Tensor:
    """Member ``member``'s dense weight or bias of a packed linear layer."""
    if leaf == "bias":
        return layer.bias.detach().reshape(members, -1)[member]
    chunks = layer.chunks
    dense = layer.dense_weight().detach()
    blocks = dense.reshape(members, layer.out_features // members, chunks, members, -1)
    return blocks[member, :, :, member, :].reshape(layer.out_features // members, -1)


@torch.no_grad()
def _start_from(packed: nn.Module, base: nn.Module, members: int) -> None:
    """Every member's backbone and pooler from ``base`` (alpha == M, gamma == 1: the widths match);
    the task modules keep their own random initialisation."""
    fresh = tuple(get_adapter(packed).task_head_modules(packed))
    layers = dict(packed.named_modules())
    base_state = base.state_dict()
    for name, tensor in packed.state_dict().items():
        if is_under(name, fresh):
            continue
        owner = name.rpartition(".")[0]
        source = base_state[name]
        if isinstance(layers.get(owner), PackedLinear):
            tensor.copy_(source.unsqueeze(0).expand_as(tensor))
        else:
            scaled = [i for i, (a, b) in enumerate(zip(tensor.shape, source.shape, strict=True)) if a != b]
            tensor.copy_(torch.cat([source] * members, dim=scaled[0]) if scaled else source)
