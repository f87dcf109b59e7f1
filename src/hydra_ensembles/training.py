"""Training helpers. `fit_linear_head`: fit a classifier head on frozen features (linear probe)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .adapters import get_adapter


@torch.no_grad()
def classifier_features(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], desc: str = "features"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of the model's final classifier layer and the labels, over ``batches``."""
    adapter = get_adapter(model)
    head = model.get_submodule(adapter.head_paths[-1])
    captured: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda _m, args: captured.append(args[0].float()))
    labels = []
    model.eval()
    try:
        for batch in tqdm(list(batches), desc=desc, leave=False, disable=None):
            labels.append(batch["labels"])
            model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        handle.remove()
    return torch.cat(captured), torch.cat(labels)


def fit_linear_head(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    steps: int = 300,
    lr: float = 1e-2,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> nn.Module:
    """Train only the final classifier layer (in place) on frozen features; returns ``model``."""
    features, labels = classifier_features(model, batches)
    adapter = get_adapter(model)
    head = model.get_submodule(adapter.head_paths[-1])
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the classifier head must be a Linear layer, got {type(head).__name__}")
    torch.manual_seed(seed)
    probe = nn.Linear(head.in_features, head.out_features)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(probe(features), labels).backward()
        optimizer.step()
    with torch.no_grad():
        head.weight.copy_(probe.weight.to(head.weight.dtype))
        head.bias.copy_(probe.bias.to(head.bias.dtype))
    return model
