"""MIMO (Havasi et al., 2020): M members in one network that reads M inputs at once.

`mimo(model, M)` returns a copy of ``model`` (same class) with

* an input layer for M inputs whose outputs are summed: for images the patch projection reads
  the M images' channels concatenated (a convolution over M*C channels is the sum of M per-input
  convolutions: Havasi et al.'s channel concatenation); for text each input's word embeddings
  go through their own linear map and are summed position by position (texts padded to one
  length; a position is attended where any input has a token). The per-input weights start as
  the pretrained ones divided by M, so M copies of one input give exactly the pretrained
  model's features at the start;
* M task heads (the classifier's output widened to M*C, a fresh initialisation), answered
  member-stacked (M*B rows, member m in rows m*B .. (m+1)*B - 1) like BatchEnsemble.

At test time the model takes ordinary inputs and feeds each to all M members (its pre-hook
repeats it), so `predict` treats it as any ensemble. Training (`train_mimo`) takes batches
whose inputs carry a member dimension, (B, M, ...), and labels (B, M): each row mixes M
training items, with batch repetition (each item in ``batch_repeat`` rows of a batch, with
different partners) and input repetition (with probability ``rho`` a row gives all members the
same item), the paper's settings being M=3, rho=0.5, batch_repeat=4.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..batching import StackMemberLogits
from ..errors import InputError
from ..models import takes_images
from ..saving.metadata import write_metadata
from ..training import FineTuneConfig, FineTuneResult, fine_tune
from .head_ensemble import initialise_like
from .registry import register_counted

MIMO_KEY = "hydra_mimo_members"
"""Config attribute recording the number of MIMO members (saved with the model)."""


class MimoTextInputs(nn.Module):
    """Per-input linear maps of the word embeddings, summed over the M inputs."""

    def __init__(self, num_members: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(width).repeat(num_members, 1, 1) / num_members)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(B, M, T, d) word embeddings -> (B, T, d) mixed input embeddings."""
        return torch.einsum("bmtd,med->bte", embeddings, self.weight)


def mimo(model: nn.Module, num_members: int = 3, seed: int = 0) -> nn.Module:
    """A MIMO copy of ``model`` (see the module docstring); ``model`` is not modified."""
    if num_members < 1:
        raise InputError(f"MIMO needs at least one member, got {num_members}")
    if mimo_members(model) > 1:
        raise InputError("the model is a MIMO model already")
    converted = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return install_mimo(converted, num_members)


def install_mimo(model: nn.Module, num_members: int) -> nn.Module:
    """Turn ``model`` into a MIMO model in place (its input layer for M inputs, M heads, the
    hooks); `mimo` does it on a copy, `load_member` on the architecture it rebuilds."""
    labels = int(model.config.num_labels)
    images = takes_images(model)
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    if images:
        _widen_patch_projection(model, num_members)
    else:
        width = model.get_input_embeddings().embedding_dim
        model.mimo_inputs = MimoTextInputs(num_members, width).to(device, dtype)
    name = get_adapter(model).task_head_modules(model)[-1]
    head = getattr(model, name)
    final_path, final = _final_linear(head, labels)
    wide = nn.Linear(final.in_features, num_members * labels, bias=final.bias is not None)
    initialise_like(model, wide)
    wide = wide.to(device, dtype)
    if final_path:
        head.set_submodule(final_path, wide)
    else:
        setattr(model, name, wide)
    write_metadata(model, member_transforms={MIMO_KEY: num_members})
    model.register_forward_pre_hook(_MixInputs(num_members, images), with_kwargs=True)
    model.register_forward_hook(StackMemberLogits(num_members, labels))
    return model


def mimo_members(model: nn.Module) -> int:
    """M for a model made by `mimo`, 1 for any other model."""
    return MIMO.stacked_members(model)


def mimo_batches(
    batches: Iterable[dict[str, Any]],
    num_members: int,
    rho: float = 0.5,
    batch_repeat: int = 4,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Training batches for a MIMO model: each batch's B items repeated ``batch_repeat`` times,
    member 0 reading them in order and every other member a shuffled order, except in the rows
    (probability ``rho``) where all members read member 0's item. Inputs become (B*r, M, ...)
    and labels (B*r, M)."""
    if not 0 <= rho <= 1 or batch_repeat < 1:
        raise InputError(f"rho must be in [0, 1] and batch_repeat >= 1, got {rho} and {batch_repeat}")
    generator = torch.Generator().manual_seed(seed)
    mixed = []
    for batch in batches:
        rows = int(batch["labels"].shape[0])
        first = torch.arange(rows).repeat(batch_repeat)
        same = torch.rand(len(first), generator=generator) < rho
        orders = [first] + [
            torch.where(same, first, first[torch.randperm(len(first), generator=generator)])
            for _ in range(num_members - 1)
        ]
        mixed.append(
            {
                key: torch.stack([value[order] for order in orders], dim=1)
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows
                else value
                for key, value in batch.items()
            }
        )
    return mixed


def train_mimo(
    model: nn.Module,
    train: Iterable[dict[str, Any]],
    config: FineTuneConfig,
    rho: float = 0.5,
    batch_repeat: int = 4,
    progress: bool = True,
) -> FineTuneResult:
    """Train a `mimo` model: every epoch on freshly mixed batches (`mimo_batches`, seeded by
    ``config.seed`` and the epoch), each member on its own labels, one learning-rate schedule over
    all epochs."""
    members = mimo_members(model)
    if members == 1:
        raise InputError("not a MIMO model: make one with mimo first")
    train = list(train)
    mixed = [
        batch
        for epoch in range(config.epochs)
        for batch in mimo_batches(train, members, rho, batch_repeat, seed=config.seed * 1000 + epoch)
    ]
    # mixed anew each epoch above, with repeated rows kept together: batches are not dealt again
    return fine_tune(model, mixed, None, replace(config, epochs=1, shuffle="batches"), progress=progress)


class _MixInputs:
    """Forward pre-hook: M inputs (B, M, ...) mixed into one; an ordinary input given to every
    member."""

    def __init__(self, num_members: int, images: bool) -> None:
        self.num_members, self.images = num_members, images

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            raise TypeError("a MIMO model takes keyword inputs (pixel_values=..., input_ids=...)")
        m = self.num_members
        if self.images:
            pixels = kwargs["pixel_values"]
            if pixels.dim() == 4:  # one image per row: every member reads it
                pixels = pixels.unsqueeze(1).expand(-1, m, *pixels.shape[1:])
            return args, {**kwargs, "pixel_values": pixels.flatten(1, 2)}
        ids = kwargs.pop("input_ids")
        if ids.dim() == 2:  # one text per row: every member reads it
            ids = ids.unsqueeze(1).expand(-1, m, -1)
        else:  # M texts per row: attend where any has a token; one segment (single-text inputs)
            if (mask := kwargs.get("attention_mask")) is not None:
                kwargs["attention_mask"] = mask.amax(dim=1)
            if (segments := kwargs.get("token_type_ids")) is not None:
                kwargs["token_type_ids"] = segments[:, 0]
        embeddings = model.get_input_embeddings()(ids)  # (B, M, T, d)
        return args, {**kwargs, "inputs_embeds": model.mimo_inputs(embeddings)}


def _widen_patch_projection(model: nn.Module, num_members: int) -> None:
    """The patch projection over M*C channels, each input's weights the old ones divided by M."""
    embeddings = model.get_submodule(get_adapter(model).embeddings_path)
    convs = [(p, m) for p, m in embeddings.named_modules() if isinstance(m, nn.Conv2d)]
    if len(convs) != 1:
        raise InputError(f"MIMO needs one patch projection in the embeddings, found {len(convs)}")
    path, conv = convs[0]
    wide = nn.Conv2d(num_members * conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                     conv.padding, bias=conv.bias is not None)  # fmt: skip
    with torch.no_grad():
        wide.weight.copy_(torch.cat([conv.weight / num_members] * num_members, dim=1))
        if conv.bias is not None:
            wide.bias.copy_(conv.bias)
    embeddings.set_submodule(path, wide.to(conv.weight.device, conv.weight.dtype))
    owner = embeddings.get_submodule(path.rpartition(".")[0])
    if hasattr(owner, "num_channels"):  # Hugging Face checks the input's channels against this
        owner.num_channels = wide.in_channels


def _final_linear(head: nn.Module, labels: int) -> tuple[str, nn.Linear]:
    """The task head's output layer (the linear with C outputs) and its path inside the head."""
    if isinstance(head, nn.Linear):
        return "", head
    finals = [
        (p, m) for p, m in head.named_modules() if isinstance(m, nn.Linear) and m.out_features == labels
    ]
    if len(finals) != 1:
        raise InputError(f"cannot find the task head's output layer in {type(head).__name__}")
    return finals[0]


MIMO = register_counted(
    "MIMO", MIMO_KEY, install_mimo, "MIMO: {members} inputs mixed into one pass, {members} task heads"
)
