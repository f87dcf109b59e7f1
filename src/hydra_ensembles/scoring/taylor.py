"""Taylor importance of attention heads (Molchanov et al. 2019; paper Appendix D.1.1).

Per head h of layer l: the mean of |W * dL/dW| over the head's rows of W_Q, W_K and W_V,
averaged over the three. dL/dW is the gradient of the mean cross-entropy over the calibration
batches (each batch's mean loss, averaged over batches). With grouped-query attention a query
head's W_K and W_V terms are those of the key/value head it reads (shared by its group).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import get_adapter
from ..batching import model_inputs
from ..errors import InputError
from ..heads import HeadSet, HeadSetError
from ..inputs import checked_batches
from ..precision import model_device, resolve_precision
from ..progress import progress_bar
from ..saving.formats import check_finite
from ..surgery import kept_heads, prune


def taylor_scores(
    model: nn.Module, calib: Iterable[dict[str, Any]], progress: bool = False, precision: str = "auto"
) -> torch.Tensor:
    """(layers, max heads) Taylor scores in original head indices; pruned heads get NaN.

    ``calib`` is an iterable of batches of model inputs with ``labels``. The model's parameters
    and ``requires_grad`` flags are left as they were; its gradients are cleared. Forward passes
    run under ``precision``'s autocast (`precision.resolve_precision`); gradients are summed in fp32.
    """
    batches = checked_batches(calib, "calib", int(model.config.num_labels), model=model)
    check_finite(model.named_parameters(), "the model to score")
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    current = kept_heads(model).resolve(original)
    blocks = [adapter.attention_block(model, layer) for layer in range(len(original))]
    qkv = [b.qkv_weights() for b in blocks]  # (parameter, rows) of W_Q, W_K, W_V per layer
    weights = list({id(p): p for rows in qkv for p, _ in rows}.values())

    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    device = model_device(model)
    compute = resolve_precision(precision, device)
    grads = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights:
            w.requires_grad_(True)
        model.eval()  # no dropout: scores are deterministic
        for batch in progress_bar(batches, desc="taylor", leave=False, enabled=progress):
            labels = batch["labels"]
            with compute.autocast(device):
                logits = model(**model_inputs(batch)).logits
            loss = F.cross_entropy(logits.float(), labels.to(logits.device)) / len(batches)
            if not torch.isfinite(loss):
                raise InputError(
                    "the loss on the calibration data is NaN or Inf (non-finite inputs, or a model "
                    "with non-finite weights): Taylor scores would be meaningless"
                )
            for acc, g in zip(grads, torch.autograd.grad(loss, weights, allow_unused=True), strict=True):
                if g is not None:
                    acc += g.float()
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)

    grad_of = {id(w): g for w, g in zip(weights, grads, strict=True)}
    scores = torch.full((len(original), max(original)), float("nan"))
    for layer, (block, kept) in enumerate(zip(blocks, current, strict=True)):
        if kept:
            scores[layer, kept] = _head_scores(block, qkv[layer], grad_of)
    return scores


def _head_scores(block, qkv: list, grad_of: dict[int, torch.Tensor]) -> torch.Tensor:
    """The scores of ``block``'s heads: per head, the mean |w * g| over its W_Q, W_K and W_V rows
    (``qkv``: (parameter, rows) of each), averaged over the three."""
    per_proj = []  # each projection's mean |w * g| per head it holds
    for param, rows in qkv:
        product = (param.detach()[rows].float() * grad_of[id(param)][rows]).abs()
        per_proj.append(product.view(product.shape[0] // block.head_dim, -1).mean(dim=1))
    # grouped-query attention: a query head's key/value terms are its group's key/value head's
    kv = torch.tensor(block.kv_index if block.kv_index is not None else range(block.num_heads))
    return (per_proj[0] + per_proj[1][kv] + per_proj[2][kv]) / 3


DECIDING_PRECISION = "fp32"
"""The precision of the scores `taylor_head_set` decides on. One exact pass costs what a bf16
pass and an fp32 check of its near-ties would (every head's score comes from one backward)."""


def taylor_head_set(
    model: nn.Module,
    calib: Iterable[dict[str, Any]],
    heads_per_layer: int | Sequence[int],
    scope: Literal["layer", "global"] = "layer",
    progress: bool = True,
) -> HeadSet:
    """Heads kept by Taylor pruning.

    ``scope="layer"``: heads kept per layer, with prune -> recompute, layer by layer (D.1.1): score,
    keep the top ``heads_per_layer`` heads of layer 0, prune, recompute gradients, then layer 1...
    ``scope="global"``: one scoring pass, the top ``sum(heads_per_layer)`` heads over all layers.
    The deciding scores are computed in fp32 on every machine: in bf16 or fp16 near-ties flip
    and the kept heads would depend on the arithmetic; exact ties go to the lower (layer, head).
    """
    batches = list(calib)
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    keep = [heads_per_layer] * len(original) if isinstance(heads_per_layer, int) else list(heads_per_layer)
    if len(keep) != len(original) or any(not 0 <= k <= h for k, h in zip(keep, original, strict=True)):
        raise HeadSetError(f"heads_per_layer must be in [0, heads] for each of the {len(original)} layers")
    if scope == "global":
        scores = taylor_scores(model, batches, precision=DECIDING_PRECISION)
        flat = sorted(
            ((scores[layer, h].item(), layer, h) for layer, n in enumerate(original) for h in range(n)),
            key=lambda t: (-t[0], t[1], t[2]),
        )
        return HeadSet.without(((layer, h) for _, layer, h in flat[sum(keep) :]), original)
    if scope != "layer":
        raise InputError(f"scope must be 'layer' or 'global', got {scope!r}")
    kept: dict[int, list[int]] = {}
    current = model
    for layer in progress_bar(range(len(original)), desc="taylor (prune -> recompute)", enabled=progress):
        scores = taylor_scores(current, batches, precision=DECIDING_PRECISION)[layer]
        ranked = sorted(range(original[layer]), key=lambda h: (-scores[h].item(), h))
        kept[layer] = sorted(ranked[: keep[layer]])
        current = prune(model, HeadSet(kept))
    return HeadSet(kept)
