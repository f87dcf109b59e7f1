"""LoRA-Ensemble members (Halbheer et al. 2024): each member a LoRA fine-tune of the same
pretrained model with its own seed, trained with `peft` and merged back into a plain model."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..training import FineTuneConfig, FineTuneResult, fine_tune


def lora_fine_tune(
    model: nn.Module,
    train: Iterable[dict[str, Any]],
    val: Iterable[dict[str, Any]] | None = None,
    config: FineTuneConfig | None = None,
    rank: int = 8,
    alpha: int = 16,
    dropout: float = 0.1,
    progress: bool = True,
) -> tuple[nn.Module, FineTuneResult]:
    """A LoRA fine-tune of a copy of ``model`` on W_Q and W_V (plus the task head), merged.

    Returns a plain model of the same class (LoRA weights merged in) and the training history.
    """
    from peft import LoraConfig, get_peft_model

    config = config or FineTuneConfig()
    targets, heads = lora_targets(model)
    torch.manual_seed(config.seed)
    lora = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, modules_to_save=heads
    )
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    settings = FineTuneConfig(**{**config.__dict__, "trainable": None})
    result = fine_tune(peft_model, train, val, settings, progress=progress)
    merged = peft_model.merge_and_unload()
    return merged.eval(), result


def lora_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """What a LoRA-Ensemble member of ``model`` trains, as peft names it: the modules that get
    adapters (W_Q and W_V, by their last name) and the modules trained in full (the task head,
    usually freshly initialised)."""
    adapter = get_adapter(model)
    q_path, _, v_path, _ = adapter.projection_paths
    return [q_path.rpartition(".")[2], v_path.rpartition(".")[2]], list(adapter.task_head_modules(model))


def lora_parts(model: nn.Module) -> Callable[[str], bool]:
    """A parameter's name in ``model`` -> whether a LoRA-Ensemble member trains it (`lora_targets`):
    every other parameter stays the pretrained model's, the same in every member."""
    targets, heads = lora_targets(model)

    def trained(name: str) -> bool:
        module = name.rpartition(".")[0]
        return module.rpartition(".")[2] in targets or any(f".{h}." in f".{name}" for h in heads)

    return trained
