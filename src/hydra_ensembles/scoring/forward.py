"""Running a model in pieces, with the Hugging Face modelling code doing the work.

`capture_layer_inputs` records the hidden states entering every layer; `run_from_layer` runs the
model from the input of layer ``l`` onwards (layers before it are skipped, their output supplied).
Both work for any family with an adapter: layers are swapped out of the model's layer list
temporarily and the embeddings' output is replaced by a forward hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..adapters import ArchitectureAdapter
from ..batching import batch_rows, repeat_rows


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module, adapter: ArchitectureAdapter, inputs: dict[str, Any]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states entering each layer, and the logits, for one batch."""
    captured: list[torch.Tensor] = []
    handles = [
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs: captured.append(_hidden_of(args, kwargs)), with_kwargs=True
        )
        for layer in adapter.layers(model)
    ]
    try:
        logits = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    return captured, logits


@contextmanager
def starting_at_layer(
    model: nn.Module, adapter: ArchitectureAdapter, layer: int, hidden: torch.Tensor
) -> Iterator[None]:
    """Within the block, a forward pass skips layers < ``layer`` and starts from ``hidden``."""
    layers = model.get_submodule(adapter.layers_path)
    embeddings = model.get_submodule(adapter.embeddings_path)
    handle = embeddings.register_forward_hook(lambda _m, _args, _out: hidden)
    model.set_submodule(adapter.layers_path, nn.ModuleList(list(layers)[layer:]))
    try:
        yield
    finally:
        model.set_submodule(adapter.layers_path, layers)
        handle.remove()


@torch.no_grad()
def run_from_layer(
    model: nn.Module,
    adapter: ArchitectureAdapter,
    layer: int,
    hidden: torch.Tensor,
    inputs: dict[str, Any],
) -> torch.Tensor:
    """Logits of the model run from the input ``hidden`` of ``layer`` (rows: ``inputs`` repeated)."""
    times = hidden.shape[0] // batch_rows(inputs)
    with starting_at_layer(model, adapter, layer, hidden):
        return model(**repeat_rows(inputs, times)).logits
