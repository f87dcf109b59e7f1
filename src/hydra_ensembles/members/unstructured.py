"""Unstructured pruning baseline at a parameter budget matched to head pruning.

The paper compares against OBA (Optimal Brain Apoptosis, Sun et al. 2025), which ranks weights
by a second-order (Hessian-vector product) estimate of the loss change. That is not implemented
here; this module implements **Wanda** (Sun et al. 2024, "A simple and effective pruning approach
for large language models"), the standard calibration-based unstructured method: weight
importance = |W_ij| * ||X_j||_2 (the input feature's norm over calibration tokens), and each
output row of every linear layer of the transformer layers drops its least important fraction.
Reports name the row "Wanda", never "OBA".

The masks are installed with `torch.nn.utils.prune`, so fine-tuning keeps pruned weights at zero;
`make_permanent` folds them into the weights before saving.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..batching import model_inputs


def prunable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers inside the transformer layers (attention and MLP), by path."""
    adapter = get_adapter(model)
    return {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and is_under(path, (adapter.layers_path,))
    }


def input_norms(model: nn.Module, calib: Iterable[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """||X_j||_2 of every input feature of every prunable linear layer over all calibration rows
    (tokens or patches; padding included, as Wanda does)."""
    linears = prunable_linears(model)
    sums = {path: torch.zeros(m.in_features, dtype=torch.float64) for path, m in linears.items()}

    def hook(path: str):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[path] += x.pow(2).sum(0)

        return record

    handles = [m.register_forward_pre_hook(hook(p)) for p, m in linears.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in calib:
                model(**model_inputs(batch))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return {path: s.sqrt().float() for path, s in sums.items()}


def wanda_masks(
    model: nn.Module, calib: Iterable[dict[str, Any]], sparsity: float
) -> dict[str, torch.Tensor]:
    """Keep-masks (1 = kept) pruning ``sparsity`` of each output row of every prunable linear."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    norms = input_norms(model, list(calib))
    masks = {}
    for path, linear in prunable_linears(model).items():
        score = linear.weight.detach().abs().float() * norms[path][None, :]
        drop = int(sparsity * linear.in_features)
        mask = torch.ones_like(score)
        if drop:
            lowest = score.topk(drop, dim=1, largest=False).indices
            mask.scatter_(1, lowest, 0.0)
        masks[path] = mask
    return masks


def wanda_prune(model: nn.Module, calib: Iterable[dict[str, Any]], sparsity: float) -> nn.Module:
    """A copy of ``model`` with Wanda's masks installed (pruned weights stay zero in training)."""
    pruned = copy.deepcopy(model)
    for path, mask in wanda_masks(pruned, calib, sparsity).items():
        torch_prune.custom_from_mask(pruned.get_submodule(path), "weight", mask.to(torch.bool))
    return pruned


def make_permanent(model: nn.Module) -> nn.Module:
    """Fold installed masks into the weights (plain ``weight`` parameters with zeros)."""
    for module in model.modules():
        if torch_prune.is_pruned(module) and hasattr(module, "weight_orig"):
            torch_prune.remove(module, "weight")
    return model


def matched_sparsity(base: nn.Module, pruned: nn.Module) -> float:
    """The share of the prunable linears' weights to zero so that as many parameters go as
    pruning heads removed from ``base`` to make ``pruned`` (the paper matches OBA's budget so)."""
    removed = sum(p.numel() for p in base.parameters()) - sum(p.numel() for p in pruned.parameters())
    total = sum(m.weight.numel() for m in prunable_linears(base).values())
    if removed < 0 or total == 0:
        raise ValueError("the pruned model must have no more parameters than the base")
    return removed / total
