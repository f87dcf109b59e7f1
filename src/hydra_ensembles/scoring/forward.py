"""Running a model in pieces, with the Hugging Face modelling code doing the work.

`capture_layer_inputs` records the hidden states entering every layer and, where the family has
one, every attention core's output; `run_from_layer` runs the model from the input of layer ``l``
onwards (layers before it are skipped, their output supplied), optionally replaying layer ``l``'s
attention core output instead of recomputing it.
Both work for any family with an adapter: layers are swapped out of the model's layer list
temporarily and the embeddings module returns the given hidden states instead of computing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn

from ..adapters import ArchitectureAdapter, DualEncoderAdapter
from ..adapters.base import optional_submodule
from ..batching import batch_rows, repeat_rows
from ..errors import InputError


class LayerCapture(NamedTuple):
    """What one forward pass records for running the model in pieces."""

    layer_inputs: list[torch.Tensor]
    """Hidden states entering each layer."""
    logits: torch.Tensor
    contexts: list[torch.Tensor | None]
    """Each layer's attention core output (``None`` where the family has no core module)."""
    embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    """A dual encoder's input and class embeddings (what a run from one tower's layer takes
    from the other tower); ``None`` for other models."""


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
            if isinstance(adapter, DualEncoderAdapter):  # both towers run; keep their embeddings
                embeddings = (model.input_tower(**inputs), model.class_embeddings())
                logits = model.logits_from(*embeddings)
            else:
                logits = model(**inputs).logits
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


@contextmanager
def starting_at_layer(
    model: nn.Module, adapter: ArchitectureAdapter, layer: int, hidden: torch.Tensor
) -> Iterator[None]:
    """Within the block, a forward pass skips layers < ``layer`` and starts from ``hidden``."""
    layers = model.get_submodule(adapter.layers_path)
    # the input modules stay (models read their weights' dtype), but compute nothing: the
    # embeddings return `hidden`, and modules after them (ELECTRA's projection) pass it on
    found = (optional_submodule(model, path) for path in adapter.input_paths)
    inputs = [module for module in found if module is not None]
    inputs[0].forward = lambda *_args, **_kwargs: hidden
    for module in inputs[1:]:
        module.forward = lambda x, *_args, **_kwargs: x
    model.set_submodule(adapter.layers_path, nn.ModuleList(list(layers)[layer:]))
    # families that pick each layer's mask by its place in the list (``config.layer_types[i]``:
    # Qwen2/3's and Gemma's sliding-window layers) see the types of the layers that run
    owner = model.get_submodule(adapter.layers_path.rpartition(".")[0])
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
        model.set_submodule(adapter.layers_path, layers)
        for module in inputs:
            del module.forward


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

    A dual encoder needs ``embeddings`` (`LayerCapture.embeddings`): only the tower holding
    ``layer`` runs, the other tower's embeddings are reused."""
    if isinstance(adapter, DualEncoderAdapter):
        if embeddings is None:
            raise InputError("running a dual encoder from a layer needs the captured embeddings")
        return _dual_from_layer(model, adapter, layer, hidden, inputs, embeddings)
    times = hidden.shape[0] // batch_rows(inputs)
    with starting_at_layer(model, adapter, layer, hidden):
        return model(**repeat_rows(inputs, times), **adapter.call_options).logits


def _dual_from_layer(model, adapter: DualEncoderAdapter, layer, hidden, inputs, embeddings) -> torch.Tensor:
    return dual_logits(
        model, adapter, layer, dual_tower_from_layer(model, adapter, layer, hidden, inputs), embeddings
    )


@torch.no_grad()
def dual_tower_from_layer(
    model: nn.Module, adapter: DualEncoderAdapter, layer: int, hidden: torch.Tensor, inputs: dict[str, Any]
) -> torch.Tensor:
    """The output of the tower holding ``layer``, run from its input ``hidden`` (R stacked
    copies): input embeddings (R*B, D) for the input tower (rows: ``inputs`` repeated), class
    embeddings (R, C, D) for the label tower (rows: the prompts repeated)."""
    path, tower_adapter, local = adapter.locate(layer)
    tower = model.get_submodule(path)
    if adapter.in_input_tower(layer):
        times = hidden.shape[0] // batch_rows(inputs)
        with starting_at_layer(tower, tower_adapter, local, hidden):
            return model.input_tower(**repeat_rows(inputs, times))
    prompts = model.prompt_inputs
    times = hidden.shape[0] // batch_rows(prompts)
    with starting_at_layer(tower, tower_adapter, local, hidden):
        prompt_embeddings = model.label_tower(**repeat_rows(prompts, times))
    return model.class_embeddings_from(prompt_embeddings.unflatten(0, (times, -1)))


def dual_logits(
    model: nn.Module,
    adapter: DualEncoderAdapter,
    layer: int,
    tower_output: torch.Tensor,
    embeddings: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Candidate-major (R*B, C) logits of `dual_tower_from_layer`'s output for ``layer`` against
    the other tower's embeddings (`LayerCapture.embeddings`)."""
    input_embeddings, class_embeddings = embeddings
    if adapter.in_input_tower(layer):
        return model.logits_from(tower_output, class_embeddings)
    return model.logits_from(input_embeddings, tower_output).flatten(0, 1)
