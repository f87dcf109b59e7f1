"""BatchEnsemble baseline (Wen et al., 2020): one model whose linear layers carry M rank-1
member factors, fine-tuned from a trained checkpoint (the paper's protocol for this baseline).

`batch_ensemble(model, M)` returns a model of the same class whose layers' and task head's
linear layers are `BatchEnsembleLinear`; embeddings and LayerNorms stay shared. It takes the
usual inputs (B rows): a pre-hook repeats them M times, so its logits come member-stacked
(M*B rows, member m in rows m*B .. (m+1)*B - 1). `fine_tune` trains every member on the labels
and `predict` returns the M members' logits, as for any ensemble.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..batching import batch_rows, repeat_call
from ..errors import InputError
from ..layers.batch_ensemble import BatchEnsembleLinear
from ..saving.metadata import write_metadata
from .registry import register_counted

BATCH_ENSEMBLE_KEY = "hydra_batch_ensemble_members"
"""Config attribute recording the number of BatchEnsemble members (saved with the model)."""
BATCH_ENSEMBLE = register_counted(
    "BatchEnsemble",
    BATCH_ENSEMBLE_KEY,
    lambda model, members: batch_ensemble(model, members, init_std=0.0),
    "BatchEnsemble of {members} members (rank-1 factors on every linear layer)",
)


def batch_ensemble(model: nn.Module, num_members: int = 3, init_std: float = 0.5, seed: int = 0) -> nn.Module:
    """A BatchEnsemble copy of ``model`` (see the module docstring); ``model`` is not modified.

    ``init_std``: spread of the rank-1 factors around 1 (diversity at the start of fine-tuning).
    """
    if num_members < 1:
        raise InputError(f"a BatchEnsemble needs at least one member, got {num_members}")
    if batch_ensemble_members(model) > 1:
        raise InputError("the model is a BatchEnsemble already")
    adapter = get_adapter(model)
    converted = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    roots = (adapter.layers_path, *adapter.head_paths)
    for path, module in list(converted.named_modules()):
        if type(module) is nn.Linear and is_under(path, roots):
            converted.set_submodule(
                path, BatchEnsembleLinear.from_linear(module, num_members, init_std, generator)
            )
    write_metadata(converted, member_transforms={BATCH_ENSEMBLE_KEY: num_members})
    converted.register_forward_pre_hook(_StackInputs(num_members), with_kwargs=True)
    return converted


def batch_ensemble_members(model: nn.Module) -> int:
    """M for a model made by `batch_ensemble`, 1 for any other model."""
    return BATCH_ENSEMBLE.stacked_members(model)


class _StackInputs:
    """Forward pre-hook: every batch-shaped input (labels included) repeated M times."""

    def __init__(self, num_members: int) -> None:
        self.num_members = num_members

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return repeat_call(args, kwargs, self.num_members, batch_rows({**dict(enumerate(args)), **kwargs}))
