"""Running a model in pieces: the whole forward pass with what each stack of layers produced, and
a forward pass that starts at one layer from given hidden states.

Every adapter runs its model this way (`PieceRunning`, part of `ArchitectureAdapter`): a single
model is one stack of layers whose output is the logits; a dual encoder's adapter overrides the
three methods for its two towers (`adapters.dual`). Circuit extraction and Taylor scoring call
these and never ask which kind of model they hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..batching import batch_rows, repeat_rows


def optional_submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule of ``module`` at the dotted ``path``, or None where there is none."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


@contextmanager
def starting_at_layer(
    model: nn.Module, layers_path: str, input_paths: tuple[str, ...], layer: int, hidden: torch.Tensor
) -> Iterator[None]:
    """Within the block, a forward pass of ``model`` skips the layers (at ``layers_path``) below
    ``layer`` and starts from ``hidden``: the input modules (``input_paths``, the first one the
    embeddings) stay, since models read their weights' dtype, but compute nothing."""
    layers = model.get_submodule(layers_path)
    found = (optional_submodule(model, path) for path in input_paths)
    inputs = [module for module in found if module is not None]
    inputs[0].forward = lambda *_args, **_kwargs: hidden
    for module in inputs[1:]:  # modules after the embeddings (ELECTRA's projection) pass it on
        module.forward = lambda x, *_args, **_kwargs: x
    model.set_submodule(layers_path, nn.ModuleList(list(layers)[layer:]))
    # families that pick each layer's mask by its place in the list (``config.layer_types[i]``:
    # Qwen2/3's and Gemma's sliding-window layers) see the types of the layers that run
    owner = model.get_submodule(layers_path.rpartition(".")[0])
    configs = {id(c): c for m in (owner, model) if (c := getattr(m, "config", None)) is not None}
    typed = [c for c in configs.values() if len(getattr(c, "layer_types", None) or ()) == len(layers)]
    saved = [c.layer_types for c in typed]
    for config in typed:
        config.layer_types = config.layer_types[layer:]
    try:
        yield
    finally:
        for config, types in zip(typed, saved, strict=True):
            config.layer_types = types
        model.set_submodule(layers_path, layers)
        for module in inputs:
            del module.forward


class PieceRunning:
    """How a family's model runs in pieces (see the module docstring). ``layers_path``,
    ``input_paths`` and ``call_options`` come from the adapter's layout."""

    layers_path: str
    input_paths: tuple[str, ...]
    call_options: dict[str, Any]

    def starting_at_layer(self, model: nn.Module, layer: int, hidden: torch.Tensor):
        """`starting_at_layer` over this adapter's layers."""
        return starting_at_layer(model, self.layers_path, self.input_paths, layer, hidden)

    def forward_outputs(
        self, model: nn.Module, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """The logits of one forward pass, and what each stack's output was where the logits
        combine several stacks (None for a single model)."""
        return model(**inputs).logits, None

    def stack_from_layer(
        self, model: nn.Module, layer: int, hidden: torch.Tensor, inputs: dict[str, Any]
    ) -> torch.Tensor:
        """The output of the stack holding ``layer`` run from its input ``hidden`` (R stacked
        copies of the batch): for a single model, its logits (rows: ``inputs`` repeated)."""
        times = hidden.shape[0] // batch_rows(inputs)
        with self.starting_at_layer(model, layer, hidden):
            return model(**repeat_rows(inputs, times), **self.call_options).logits

    def logits_from_stack(
        self,
        model: nn.Module,
        layer: int,
        output: torch.Tensor,
        outputs: tuple[torch.Tensor, ...] | None,
    ) -> torch.Tensor:
        """Logits from `stack_from_layer`'s ``output`` for ``layer``, the other stacks' outputs
        taken from ``outputs`` (`forward_outputs`): for a single model, ``output`` itself."""
        return output
