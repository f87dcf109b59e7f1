"""Running a model in pieces, with the Hugging Face modelling code doing the work.

`capture_layer_inputs` records the hidden states entering every layer and, where the family has
one, every attention core's output; `run_from_layer` runs the model from the input of layer ``l``
onwards (layers before it are skipped, their output supplied), optionally replaying layer ``l``'s
attention core output instead of recomputing it.
Both work for any family with an adapter, through the adapter's `adapters.running.PieceRunning`:
layers are swapped out of the model's layer list temporarily and the embeddings module returns
the given hidden states instead of computing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from ..adapters import ArchitectureAdapter


class LayerCapture(NamedTuple):
    """What one forward pass records for running the model in pieces."""

    layer_inputs: list[torch.Tensor]
    """Hidden states entering each layer."""
    logits: torch.Tensor
    contexts: list[torch.Tensor | None]
    """Each layer's attention core output (``None`` where the family has no core module)."""
    embeddings: tuple[torch.Tensor, ...] | None = None
    """The outputs of the model's stacks where its logits combine several (a dual encoder's input
    and class embeddings: what a run from one tower's layer takes from the other tower); ``None``
    for a single model."""


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def capturing_layer_inputs(
    model: nn.Module, adapter: ArchitectureAdapter, layers: Iterable[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, the hidden states entering ``layers`` are recorded in the yielded dict."""
    captured: dict[int, torch.Tensor] = {}
    modules = adapter.layers(model)
    handles = [
        modules[k].register_forward_pre_hook(
            lambda _m, args, kwargs, k=k: captured.__setitem__(k, _hidden_of(args, kwargs)), with_kwargs=True
        )
        for k in layers
    ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, adapter: ArchitectureAdapter, inputs: dict[str, Any]
) -> LayerCapture:
    """Hidden states entering each layer, the logits, and each layer's attention core output
    (``None`` where the family has no core module), for one batch."""
    num_layers = adapter.num_layers(model)
    core_outputs: list[torch.Tensor | None] = [None] * num_layers
    handles = []
    for layer in range(num_layers):
        path = adapter.attention_core_path(layer)
        if path is not None:
            handles.append(
                model.get_submodule(path).register_forward_hook(
                    lambda _m, _a, out, layer=layer: core_outputs.__setitem__(layer, out[0])
                )
            )
    embeddings = None
    try:
        with capturing_layer_inputs(model, adapter, range(num_layers)) as captured:
            logits, embeddings = adapter.forward_outputs(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return LayerCapture([captured[k] for k in range(num_layers)], logits, core_outputs, embeddings)


class _Replay(nn.Module):
    """Stands in for an attention core: returns a precomputed ``(context, None)``."""

    def __init__(self, context: torch.Tensor) -> None:
        super().__init__()
        self.context = context

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return self.context, None


@contextmanager
def replaying_core(model: nn.Module, path: str | None, context: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the attention core at ``path`` returns ``context`` without computing."""
    if path is None or context is None:
        yield
        return
    core = model.get_submodule(path)
    model.set_submodule(path, _Replay(context))
    try:
        yield
    finally:
        model.set_submodule(path, core)


@torch.no_grad()
def run_from_layer(
    model: nn.Module,
    adapter: ArchitectureAdapter,
    layer: int,
    hidden: torch.Tensor,
    inputs: dict[str, Any],
    embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits of the model run from the input ``hidden`` of ``layer`` (rows: ``inputs`` repeated).

    A model of several stacks (a dual encoder) needs the other stacks' outputs ``embeddings``
    (`LayerCapture.embeddings`): only the stack holding ``layer`` runs."""
    output = adapter.stack_from_layer(model, layer, hidden, inputs)
    return adapter.logits_from_stack(model, layer, output, embeddings)
