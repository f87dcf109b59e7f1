"""Unstructured pruning baselines at a parameter budget matched to head pruning: OBA and Wanda.

Both zero individual weights of the linear layers inside the transformer layers (attention and
MLP; `prunable_linears`), as many as head pruning removes parameters (`matched_sparsity`), and
share one path from masks to a model (`unstructured_prune`): the masks are installed with
`torch.nn.utils.prune`, so fine-tuning keeps the pruned weights at zero, and `make_permanent`
folds them into the weights before saving.

**OBA** (Optimal Brain Apoptosis, Sun et al., ICLR 2025; the unstructured baseline of the Hydra
Ensembles paper). Removing the candidate weights moves them by delta = -theta; the second-order
Taylor expansion of the loss, L(theta + delta) - L(theta) ~ g.delta + 1/2 delta.H.delta, splits
into one term per weight, which OBA takes as that weight's score::

    s_i = g_i delta_i + 1/2 delta_i (H delta)_i,      delta = -theta (every prunable weight)

with g and H the gradient and the **exact** Hessian of the mean cross-entropy over the
calibration examples, restricted to the prunable weights. ``(H delta)`` is one Hessian-vector
product, computed here by double backward (reverse over reverse; attention runs on SDPA's math
kernel, whose backward is differentiable: `analysis.curvature.Differentiable`, as for the
curvature analysis). The OBA paper's own device (splitting the Hessian into
inter-layer blocks and propagating them forward layer by layer) is an efficiency device for the
same product; it is not used here. ``first_order=False`` drops the g term, as the authors'
release does by default for unstructured pruning (``--delta 0``); near a minimum g ~ 0 anyway.
The sum of every s_i is the Taylor estimate of removing every prunable weight; the estimate for
removing one chosen set is `taylor_loss_change`.

Ranking, as the authors' released unstructured pruner does it: each layer's |s| divided by its
largest, plus |w| (which breaks the ties among weights whose scores vanish), then one global
threshold over all prunable weights. The release prunes iteratively (49 rounds of rescoring on
200 batches each, with an exponential schedule); here the weights are pruned in one shot at the
matched budget and then fine-tuned, as the Hydra paper's protocol prunes once then fine-tunes.
Scores are always computed in float32 (a bf16 or fp16 model is scored on a float32 copy of its
weights; second derivatives in those formats would be mostly rounding) and summed in float64.

**Wanda** (Sun et al. 2024, "A simple and effective pruning approach for large language
models"): importance |W_ij| * ||X_j||_2 (the input feature's norm over the calibration tokens);
each output row of every prunable linear drops its least important fraction.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune as torch_prune

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..analysis.curvature import Differentiable
from ..batching import batch_rows, model_inputs
from ..errors import InputError
from ..inputs import checked_batches
from ..progress import progress_bar
from ..saving.formats import check_finite

Method = Literal["oba", "wanda"]
Masks = dict[str, torch.Tensor]
"""Keep-masks by linear path: 1 keeps the weight, 0 prunes it."""


def prunable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers inside the transformer layers (attention and MLP), by path."""
    adapter = get_adapter(model)
    return {
        path: module
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and is_under(path, (adapter.layers_path,))
    }


def _check_sparsity(sparsity: float) -> None:
    if not 0 <= sparsity < 1:
        raise InputError(f"sparsity must be in [0, 1), got {sparsity}")


# --- OBA ----------------------------------------------------------------------------------------


def _float32(model: nn.Module) -> nn.Module:
    """``model`` itself when every parameter is float32, else a float32 copy."""
    if all(p.dtype == torch.float32 for p in model.parameters()):
        return model
    return copy.deepcopy(model).float()


@torch.inference_mode(False)  # differentiable whatever the caller's mode (the copy too)
@torch.enable_grad()
def taylor_terms(
    model: nn.Module,
    calib: Iterable[dict[str, Any]],
    direction: dict[str, torch.Tensor],
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The gradient g and the exact Hessian-vector product H d of the mean cross-entropy over all
    calibration examples, with respect to the prunable linears' weights, for the direction
    ``d`` given per linear path (float64 results by path; a path missing from ``direction``
    moves by 0). The model's parameters, ``requires_grad`` flags and mode are left as they were."""
    batches = checked_batches(calib, "calib", int(model.config.num_labels), model=model)
    if any(torch_prune.is_pruned(m) for m in prunable_linears(model).values()):
        raise InputError("the model has pruning masks installed: fold them in with make_permanent first")
    scored = _float32(model)
    check_finite(scored.named_parameters(), "the model to score")
    weights = {path: linear.weight for path, linear in prunable_linears(scored).items()}
    unknown = set(direction) - set(weights)
    if unknown:
        raise InputError(f"not prunable linears of this model: {sorted(unknown)[:3]}")
    d = {p: _normal(direction[p]).to(w.device, torch.float32) for p, w in weights.items() if p in direction}
    totals = {p: torch.zeros((2, *w.shape), dtype=torch.float64, device=w.device) for p, w in weights.items()}
    examples = sum(batch_rows(b) for b in batches)
    with Differentiable(scored, list(weights.values())):  # eval (no dropout), math attention
        for batch in progress_bar(batches, desc="oba", leave=False, enabled=progress):
            for p, (g, hv) in _gradient_and_hvp(scored, batch, weights, d, examples).items():
                totals[p][0] += g
                totals[p][1] += hv
    return {p: t[0] for p, t in totals.items()}, {p: t[1] for p, t in totals.items()}


def _normal(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a normal copy of a tensor made in inference mode (autograd cannot save those)."""
    return tensor.clone() if tensor.is_inference() else tensor


def _gradient_and_hvp(
    model: nn.Module,
    batch: dict[str, Any],
    weights: dict[str, torch.Tensor],
    direction: dict[str, torch.Tensor],
    examples: int,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One batch's share (its summed loss over all ``examples``) of g and H d, float64, by path,
    by double backward (under `Differentiable`)."""
    params = list(weights.values())
    batch = {k: _normal(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    logits = model(**model_inputs(batch)).logits.float()
    loss = F.cross_entropy(logits, batch["labels"].to(logits.device), reduction="sum") / examples
    if not torch.isfinite(loss):
        raise InputError("the loss on the calibration data is NaN or Inf: OBA scores would be meaningless")
    grads = dict(zip(weights, torch.autograd.grad(loss, params, create_graph=True), strict=True))
    hvps: tuple[torch.Tensor | None, ...] = (None,) * len(params)
    if direction:
        dot = sum((grads[p] * d).sum() for p, d in direction.items())
        hvps = torch.autograd.grad(dot, params, allow_unused=True)
    return {
        p: (
            grads[p].detach().double(),
            torch.zeros_like(grads[p], dtype=torch.float64) if h is None else h.double(),
        )
        for p, h in zip(weights, hvps, strict=True)
    }


def oba_scores(
    model: nn.Module, calib: Iterable[dict[str, Any]], first_order: bool = True, progress: bool = False
) -> dict[str, torch.Tensor]:
    """Each prunable weight's OBA score s_i = g_i d_i + 1/2 d_i (H d)_i with d = -theta (signed,
    float64, by linear path): its share of the second-order Taylor estimate of the loss change
    when every prunable weight is removed. ``first_order=False`` leaves out g_i d_i."""
    delta = {p: -m.weight.detach().float() for p, m in prunable_linears(model).items()}
    grads, hvps = taylor_terms(model, calib, delta, progress=progress)
    scores = {}
    for p, d in delta.items():
        d = d.double().to(hvps[p].device)
        scores[p] = 0.5 * d * hvps[p] + (d * grads[p] if first_order else 0.0)
    return scores


def taylor_loss_change(model: nn.Module, calib: Iterable[dict[str, Any]], masks: Masks) -> float:
    """The second-order Taylor estimate g.d + 1/2 d.H.d of the change of the mean cross-entropy
    on ``calib`` when the weights that ``masks`` prune are set to zero (d = -theta on them)."""
    linears = prunable_linears(model)
    delta = {p: -linears[p].weight.detach().float() * (1 - masks[p].float()) for p in masks}
    grads, hvps = taylor_terms(model, calib, delta)
    return float(sum((d.double() * (grads[p] + 0.5 * hvps[p])).sum() for p, d in delta.items()))


def oba_masks(
    model: nn.Module,
    calib: Iterable[dict[str, Any]],
    sparsity: float,
    first_order: bool = True,
    progress: bool = False,
) -> Masks:
    """Keep-masks pruning the ``sparsity`` share of all prunable weights with the lowest OBA
    importance (|s| over its layer's largest |s|, plus |w|), one global threshold."""
    _check_sparsity(sparsity)
    scores = oba_scores(model, calib, first_order=first_order, progress=progress)
    linears = prunable_linears(model)
    importance = {}
    for p, s in scores.items():
        top = s.abs().max()
        normalised = s.abs() / top if top > 0 else torch.zeros_like(s)
        importance[p] = normalised + linears[p].weight.detach().double().abs().to(s.device)
    return _global_masks(importance, sparsity)


def _global_masks(importance: dict[str, torch.Tensor], sparsity: float) -> Masks:
    """Masks dropping exactly round(sparsity x total) weights, the least important over all."""
    flat = torch.cat([v.flatten().cpu() for v in importance.values()])
    keep = torch.ones_like(flat, dtype=torch.float32)
    drop = round(sparsity * flat.numel())
    if drop:
        keep[flat.topk(drop, largest=False).indices] = 0.0
    masks, start = {}, 0
    for p, v in importance.items():
        masks[p] = keep[start : start + v.numel()].view(v.shape).to(v.device)
        start += v.numel()
    return masks


# --- Wanda --------------------------------------------------------------------------------------


def input_norms(model: nn.Module, calib: Iterable[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """||X_j||_2 of every input feature of every prunable linear layer over all calibration rows
    (tokens or patches; padding included, as Wanda does)."""
    linears = prunable_linears(model)
    sums = {path: torch.zeros(m.in_features, dtype=torch.float64) for path, m in linears.items()}

    def hook(path: str):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[path] += x.pow(2).sum(0).cpu()

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


def wanda_masks(model: nn.Module, calib: Iterable[dict[str, Any]], sparsity: float) -> Masks:
    """Keep-masks pruning ``sparsity`` of each output row of every prunable linear."""
    _check_sparsity(sparsity)
    norms = input_norms(model, list(calib))
    masks = {}
    for path, linear in prunable_linears(model).items():
        score = linear.weight.detach().abs().float() * norms[path][None, :].to(linear.weight.device)
        drop = int(sparsity * linear.in_features)
        mask = torch.ones_like(score)
        if drop:
            lowest = score.topk(drop, dim=1, largest=False).indices
            mask.scatter_(1, lowest, 0.0)
        masks[path] = mask
    return masks


# --- shared ---------------------------------------------------------------------------------------

MASKERS: dict[str, Callable[[nn.Module, list[dict[str, Any]], float], Masks]] = {
    "oba": oba_masks,
    "wanda": wanda_masks,
}
"""Each unstructured method's masks from (model, calibration batches, sparsity)."""


def unstructured_prune(
    model: nn.Module, calib: Iterable[dict[str, Any]], sparsity: float, method: Method
) -> nn.Module:
    """A copy of ``model`` with ``method``'s masks installed (pruned weights stay zero in training)."""
    if method not in MASKERS:
        raise InputError(f"unknown unstructured method {method!r}: choose from {sorted(MASKERS)}")
    pruned = copy.deepcopy(model)
    for path, mask in MASKERS[method](pruned, list(calib), sparsity).items():
        module = pruned.get_submodule(path)
        torch_prune.custom_from_mask(module, "weight", mask.to(module.weight.device, torch.bool))
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
        raise InputError("the pruned model must have no more parameters than the base")
    return removed / total
