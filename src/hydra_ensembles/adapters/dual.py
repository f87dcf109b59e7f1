"""Dual encoders (`zero_shot.DualEncoderClassifier`): the heads of two towers as one model.

Layers are numbered across the towers whose heads are pruned: the input tower's layers first,
then the label tower's. Each tower keeps its own family's adapter; this one maps a joint layer
index to (tower, layer) and forwards, so pruning, ablation, Taylor scores and circuit extraction
see one list of layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..batching import batch_rows, repeat_rows
from ..errors import InputError
from .base import ArchitectureAdapter, AttentionBlock
from .registry import get_adapter


class DualEncoderAdapter(ArchitectureAdapter):
    """Joint layer numbering over ``model.tower_paths`` (see the module docstring)."""

    family = "dual encoder (zero-shot)"
    model_types = ("hydra_dual_encoder",)

    def __init__(self, model: nn.Module) -> None:
        self.prefix = ""
        self.layers_path = ""
        self.parts: list[tuple[str, ArchitectureAdapter, range]] = []
        """(tower path, its adapter, its joint layer indices) per pruned tower."""
        start = 0
        for path in model.tower_paths:
            tower = model.get_submodule(path)
            adapter = get_adapter(tower)
            count = adapter.num_layers(tower)
            self.parts.append((path, adapter, range(start, start + count)))
            start += count

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return bool(getattr(model, "is_dual_encoder", False))

    @property
    def spans(self) -> dict[str, range]:
        """The joint layer indices of each pruned tower."""
        return {path: span for path, _, span in self.parts}

    def locate(self, layer: int) -> tuple[str, ArchitectureAdapter, int]:
        """(tower path, tower adapter, layer within the tower) of joint layer ``layer``."""
        for path, adapter, span in self.parts:
            if layer in span:
                return path, adapter, layer - span.start
        raise IndexError(f"layer {layer} out of range")

    def in_input_tower(self, layer: int) -> bool:
        """Whether joint layer ``layer`` belongs to the input tower (the first part)."""
        return layer in self.parts[0][2]

    def encoder_config(self, model: nn.Module):
        path, adapter, _ = self.parts[0]
        return adapter.encoder_config(model.get_submodule(path))

    def layers(self, model: nn.Module) -> list[nn.Module]:
        return [
            layer for path, adapter, _ in self.parts for layer in adapter.layers(model.get_submodule(path))
        ]

    def original_heads_per_layer(self, model: nn.Module) -> list[int]:
        return [
            count
            for path, adapter, _ in self.parts
            for count in adapter.original_heads_per_layer(model.get_submodule(path))
        ]

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        path, adapter, local = self.locate(layer)
        return dataclasses.replace(adapter.attention_block(model.get_submodule(path), local), layer=layer)

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        path, adapter, local = self.locate(layer)
        adapter.set_attention(model.get_submodule(path), local, query, key, value, output, num_heads, heads)

    def install_fused_attention(self, model, layer, fused) -> None:
        raise TypeError("a dual encoder is fused per tower: use zero_shot.fuse_dual_encoder")

    def attention_paths(self, layer: int) -> tuple[str, ...]:
        path, adapter, local = self.locate(layer)
        return tuple(f"{path}.{p}" for p in adapter.attention_paths(local))

    def attention_core_path(self, layer: int) -> str | None:
        path, adapter, local = self.locate(layer)
        core = adapter.attention_core_path(local)
        return None if core is None else f"{path}.{core}"

    def input_names(self, model: nn.Module) -> tuple[str, ...]:
        path, adapter, _ = self.parts[0]
        return adapter.input_names(model.get_submodule(path))

    # ------------------------------------------------------------------ running in pieces
    def forward_outputs(self, model, inputs):
        """Both towers run; their outputs (input and class embeddings) are kept."""
        embeddings = (model.input_tower(**inputs), model.class_embeddings())
        return model.logits_from(*embeddings), embeddings

    def stack_from_layer(
        self, model: nn.Module, layer: int, hidden: torch.Tensor, inputs: dict[str, Any]
    ) -> torch.Tensor:
        """The output of the tower holding ``layer``, run from its input ``hidden`` (R stacked
        copies): input embeddings (R*B, D) for the input tower (rows: ``inputs`` repeated), class
        embeddings (R, C, D) for the label tower (rows: the prompts repeated)."""
        path, tower_adapter, local = self.locate(layer)
        tower = model.get_submodule(path)
        if self.in_input_tower(layer):
            times = hidden.shape[0] // batch_rows(inputs)
            with tower_adapter.starting_at_layer(tower, local, hidden):
                return model.input_tower(**repeat_rows(inputs, times))
        prompts = model.prompt_inputs
        times = hidden.shape[0] // batch_rows(prompts)
        with tower_adapter.starting_at_layer(tower, local, hidden):
            prompt_embeddings = model.label_tower(**repeat_rows(prompts, times))
        return model.class_embeddings_from(prompt_embeddings.unflatten(0, (times, -1)))

    def logits_from_stack(self, model, layer, output, outputs):
        """Candidate-major (R*B, C) logits of one tower's ``output`` against the other tower's
        embeddings in ``outputs``."""
        if outputs is None:
            raise InputError("running a dual encoder from a layer needs the other tower's embeddings")
        input_embeddings, class_embeddings = outputs
        if self.in_input_tower(layer):
            return model.logits_from(output, class_embeddings)
        return model.logits_from(input_embeddings, output).flatten(0, 1)
