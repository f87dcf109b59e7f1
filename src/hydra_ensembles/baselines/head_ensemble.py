"""Deep Ensembles (D), the paper's cheap text baseline (section 5.2): one fine-tuned backbone
shared by M task heads, each initialised from its own seed and trained on the frozen backbone.

`head_ensemble(model, M)` returns a copy of ``model`` (same class) whose task head is
`MemberHeads`: M fresh copies of the head reading the same input. The backbone runs once on the
B input rows and the logits come member-stacked (M*B rows, member m in rows m*B .. (m+1)*B - 1),
the convention of BatchEnsemble, so `predict` and `fine_tune` treat it as any ensemble.
`train_head_ensemble` trains only the heads (the backbone stays as fine-tuned).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..batching import batch_rows, model_inputs
from ..errors import InputError
from ..saving.metadata import write_metadata
from ..training import FineTuneConfig, FineTuneResult, fine_tune
from .registry import register_counted

HEAD_ENSEMBLE_KEY = "hydra_head_ensemble_members"
"""Config attribute recording the number of task heads (saved with the model)."""


class MemberHeads(nn.Module):
    """M copies of one task-head module. Given the B rows the backbone computed, each head reads
    them all and the outputs are stacked along the batch (M*B rows); given M*B member-stacked
    rows (the output of an earlier `MemberHeads`, e.g. DistilBERT's ``pre_classifier`` before its
    ``classifier``), head m reads member m's rows."""

    def __init__(self, heads: Iterable[nn.Module]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)
        self.batch_rows: int | None = None
        """The model's input rows in the current forward (set by the model's pre-hook)."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        members = len(self.heads)
        if self.batch_rows is not None and members > 1 and hidden.shape[0] == members * self.batch_rows:
            chunks = hidden.chunk(members)
            return torch.cat([head(x, *args, **kwargs) for head, x in zip(self.heads, chunks, strict=True)])
        return torch.cat([head(hidden, *args, **kwargs) for head in self.heads])


class _RecordRows:
    """Forward pre-hook: tell every `MemberHeads` how many rows the model's input has."""

    def __init__(self, heads: list[MemberHeads]) -> None:
        self.heads = heads

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        rows = batch_rows({**dict(enumerate(args)), **kwargs})
        for head in self.heads:
            head.batch_rows = rows


def head_ensemble(model: nn.Module, num_members: int = 3, seed: int = 0) -> nn.Module:
    """A copy of ``model`` with ``num_members`` task heads, head m initialised as the model family
    initialises a new head, from seed ``seed + m``; ``model`` is not modified."""
    if num_members < 1:
        raise InputError(f"an ensemble needs at least one member, got {num_members}")
    if head_ensemble_members(model) > 1:
        raise InputError("the model has an ensemble of heads already")
    names = get_adapter(model).task_head_modules(model)
    if not names:
        raise InputError(f"{type(model).__name__} has no task head to ensemble")
    converted = copy.deepcopy(model)
    installed = []
    for name in names:
        heads = []
        for m in range(num_members):
            head = copy.deepcopy(getattr(model, name))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + m)
                for module in head.modules():
                    initialise_like(converted, module)
            heads.append(head)
        installed.append(MemberHeads(heads))
        setattr(converted, name, installed[-1])
    write_metadata(converted, member_transforms={HEAD_ENSEMBLE_KEY: num_members})
    converted.register_forward_pre_hook(_RecordRows(installed), with_kwargs=True)
    return converted


def initialise_like(model: nn.Module, module: nn.Module) -> None:
    """Initialise ``module`` as ``model``'s family initialises new weights (Hugging Face's
    ``_init_weights``), or with PyTorch's defaults where the model has none."""
    init = getattr(model, "_init_weights", None)
    if init is not None and isinstance(module, nn.Linear):
        init(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def head_ensemble_members(model: nn.Module) -> int:
    """M for a model made by `head_ensemble`, 1 for any other model."""
    return HEAD_ENSEMBLE.stacked_members(model)


def train_head_ensemble(
    model: nn.Module,
    train: Iterable[dict[str, Any]],
    config: FineTuneConfig,
    val: Iterable[dict[str, Any]] | None = None,
    progress: bool = True,
) -> FineTuneResult:
    """Train only the `MemberHeads` of a `head_ensemble` model (each head on the mean loss of the
    members, so each head gets its own gradient); the shared backbone stays frozen.

    Where the task head is one module (every family but DistilBERT, whose head is two modules
    with code between them), the frozen backbone runs once per item and the heads train on its
    cached output, so they can train to convergence for the price of one forward pass: with
    ``val`` (ID validation) and ``config.patience``, for up to ``config.epochs`` epochs, stopping
    at the best validation NLL. Otherwise every step runs the whole model.
    """
    heads = [module for module in model.modules() if isinstance(module, MemberHeads)]
    if not heads:
        raise InputError("the model has no MemberHeads: make it with head_ensemble first")
    if len(heads) == 1:
        head_only = _CachedHeadInputs(heads[0], model.config)
        return fine_tune(
            head_only,
            head_only.cache(model, train),
            None if val is None else head_only.cache(model, val),
            replace(config, trainable=None),
            progress=progress,
        )
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    for param in model.parameters():
        param.requires_grad_(False)
    for module in heads:
        for param in module.parameters():
            param.requires_grad_(True)
    try:
        return fine_tune(model, train, val, replace(config, trainable=None), progress=progress)
    finally:
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])


class _CachedHeadInputs(nn.Module):
    """The task heads of a head ensemble as a model of their own, fed what the frozen backbone
    computed for each item (batches ``{"head_input": ..., "labels": ...}``)."""

    def __init__(self, heads: MemberHeads, config: Any) -> None:
        super().__init__()
        self.heads, self.config = heads, config

    @torch.no_grad()
    def cache(self, model: nn.Module, batches: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the heads read for each batch (the model in eval mode: no dropout)."""
        seen: list[torch.Tensor] = []

        def keep(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if len(args) != 1 or kwargs:
                raise InputError("cached head training needs a head that reads one tensor")
            seen.append(args[0].detach())

        was_training = model.training
        model.eval()
        handle = self.heads.register_forward_pre_hook(keep, with_kwargs=True)
        cached = []
        try:
            for batch in batches:
                model(**model_inputs(batch))
                cached.append({"head_input": seen.pop(), "labels": batch["labels"]})
        finally:
            handle.remove()
            model.train(was_training)
        return cached

    def forward(self, head_input: torch.Tensor) -> SimpleNamespace:
        self.heads.batch_rows = None  # B rows in: every head reads them all
        return SimpleNamespace(logits=self.heads(head_input))


HEAD_ENSEMBLE = register_counted(
    "Deep Ensemble (D)",
    HEAD_ENSEMBLE_KEY,
    head_ensemble,
    "Deep Ensemble (D): one backbone, {members} task heads",
)
