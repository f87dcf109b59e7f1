"""Head surgery: reversible ablation (masking) and structural pruning.

A pruned model records which original heads it keeps and a fingerprint of the model it was pruned
from in its metadata (`saving.metadata`: ``kept_heads``, ``base_fingerprint``), so it can be pruned
again, saved, and fused with its siblings while members from another base are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from .adapters import AttentionBlock, get_adapter
from .adapters.base import slice_linear
from .errors import InputError, UnsupportedModelError
from .hashing import fingerprint
from .heads import HeadSet, HeadSetError
from .saving.metadata import read_metadata, write_metadata


# --------------------------------------------------------------------------- records
def kept_heads(model: nn.Module) -> HeadSet:
    """The original heads ``model`` keeps (all of them unless it was made by `prune`)."""
    return read_metadata(model).kept_heads or HeadSet()


def original_heads_per_layer(model: nn.Module) -> list[int]:
    """Head counts of the unpruned architecture, per layer."""
    return get_adapter(model).original_heads_per_layer(model)


def base_fingerprint(model: nn.Module) -> str:
    """The fingerprint of the unpruned model ``model`` descends from (its own if not pruned)."""
    return read_metadata(model).base_fingerprint or fingerprint(model)


# --------------------------------------------------------------------------- pruning
def prune(model: nn.Module, heads: HeadSet) -> nn.Module:
    """A new, structurally smaller model of the same class keeping only ``heads``.

    Rows of W_Q, W_K, W_V (and biases) and columns of W_O of the dropped heads are removed and
    head counts updated; a layer may keep no heads (its attention then adds only W_O's bias).
    ``heads`` uses original head indices; pruning a pruned model needs a subset of what it keeps.
    The input model is left untouched.
    """
    if not isinstance(heads, HeadSet):
        raise TypeError(f"heads must be a HeadSet, got {type(heads).__name__}")
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    target = heads.resolve(original)
    current = kept_heads(model).resolve(original)
    for layer, (want, have) in enumerate(zip(target, current, strict=True)):
        missing = sorted(set(want) - set(have))
        if missing:
            raise HeadSetError(f"layer {layer}: heads {missing} were already pruned from this model")

    base_print = base_fingerprint(model)
    pruned = copy.deepcopy(model)
    for layer, (want, have) in enumerate(zip(target, current, strict=True)):
        if want == have:
            continue
        block = adapter.attention_block(pruned, layer)
        q, k, v, o = slice_projections(block, [have.index(h) for h in want])
        adapter.set_attention(pruned, layer, q, k, v, o, num_heads=len(want), heads=want)
    write_metadata(pruned, kept_heads=HeadSet(dict(enumerate(target))), base_fingerprint=base_print)
    forget_calibration(pruned)
    return pruned


def prune_mlp(model: nn.Module, keep: int) -> nn.Module:
    """A new model of the same class whose MLPs keep ``keep`` hidden neurons in every layer.

    Each layer's MLP is its linear layers outside attention: those giving the hidden width (the
    input projection; a gated MLP's gate and up projections) and the one reading it (the output
    projection). Neuron j's importance is the product of the norms of its input rows and of its
    output column (the largest change its removal can make to the layer's output, per unit of
    activation); the ``keep`` most important are kept, in their order, and the configuration's
    hidden width set to ``keep``, so the model saves and loads as any other of its class. The
    function changes, so the members of a build are fine-tuned after it. The input is left
    untouched; UnsupportedModelError for a family whose MLP is not that shape (a fused
    gate-and-up matrix)."""
    adapter = get_adapter(model)
    width = adapter.mlp_width(model)
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 < keep <= width:
        raise InputError(f"an MLP keeps between 1 and its {width} neurons, got {keep!r}")
    pruned = copy.deepcopy(model)
    if keep == width:
        return pruned
    adapter.set_mlp_width(pruned, keep)  # refused before anything is cut where it cannot be recorded
    for layer, block in enumerate(adapter.layers(pruned)):
        inputs, output = _mlp_linears(adapter, pruned, layer, block, width)
        with torch.no_grad():
            importance = torch.linalg.vector_norm(output.weight.float(), dim=0)
            for linear in inputs:
                importance = importance * torch.linalg.vector_norm(linear.weight.float(), dim=1)
        kept = importance.topk(keep).indices.sort().values
        paths = {id(m): path for path, m in block.named_modules()}
        for linear in inputs:
            block.set_submodule(paths[id(linear)], slice_linear(linear, kept, 0))
        block.set_submodule(paths[id(output)], slice_linear(output, kept, 1))
    forget_calibration(pruned)
    return pruned


def _mlp_linears(adapter, model: nn.Module, layer: int, block: nn.Module, width: int):
    """``layer``'s MLP: the linear layers giving ``width`` outputs and the one reading them."""
    b = adapter.attention_block(model, layer)
    attention = {id(m) for m in (b.query, b.key, b.value, b.output)}
    linears = [m for m in block.modules() if isinstance(m, nn.Linear) and id(m) not in attention]
    inputs = [m for m in linears if m.out_features == width and m.in_features != width]
    outputs = [m for m in linears if m.in_features == width and m.out_features != width]
    if not inputs or len(outputs) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} layer {layer}: its MLP is not linear layers into and out of "
            f"{width} neurons, which MLP pruning needs"
        )
    return inputs, outputs[0]


def forget_calibration(model: nn.Module) -> None:
    """Remove the calibration from ``model``'s configuration: its function changed (pruned, fused,
    trained), so the temperature and flag threshold fit for the old one no longer hold."""
    if getattr(model, "config", None) is not None:
        write_metadata(model, calibration=None, statistics=None)


def slice_projections(
    block: AttentionBlock, positions: Sequence[int]
) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """Copies of a block's (query, key, value, output) keeping the heads at ``positions``.

    ``positions`` index the block's current heads; an empty list gives 0-head projections. With
    grouped-query attention key/value keep the heads the kept query heads read (in order).
    """
    for linear in (block.query, block.key, block.value, block.output):
        if type(linear) is not nn.Linear:
            raise TypeError(
                f"layer {block.layer}: heads can be pruned from plain nn.Linear projections only, "
                f"not {type(linear).__name__} (e.g. a BatchEnsemble: prune before converting)"
            )
    rows = _head_rows(positions, block.head_dim)
    kv_rows = rows  # grouped-query attention: the key/value heads the kept query heads read
    if block.kv_index is not None:
        kv_rows = _head_rows(sorted({block.kv_index[p] for p in positions}), block.head_dim)
    q = slice_linear(block.query, rows, dim=0)
    k, v = (slice_linear(lin, kv_rows, dim=0) for lin in (block.key, block.value))
    return q, k, v, slice_linear(block.output, rows, dim=1)


def _head_rows(positions: Sequence[int], head_dim: int) -> torch.Tensor | None:
    """The rows of a projection's heads at ``positions`` (``None`` for no heads)."""
    if not positions:
        return None
    return torch.cat([torch.arange(p * head_dim, (p + 1) * head_dim) for p in positions])


# --------------------------------------------------------------------------- ablation
class HeadAblation:
    """Multiply each head's output by a mask entry, before W_O, through forward pre-hooks.

    Shapes and weights are untouched and nothing is copied per call: change ``mask`` in place
    (``mask[layer, head] = 0``) and the next forward sees it. ``mask`` is indexed by original
    heads; heads a pruned model no longer has are ignored. Use as a context manager, or call
    `remove` to restore the model.
    """

    def __init__(self, model: nn.Module, mask: torch.Tensor | None = None) -> None:
        adapter = get_adapter(model)
        original = adapter.original_heads_per_layer(model)
        current = kept_heads(model).resolve(original)
        width = max(original, default=0)
        if mask is None:
            mask = torch.ones(len(original), width)
        if tuple(mask.shape) != (len(original), width):
            raise InputError(f"mask must have shape {(len(original), width)}, got {tuple(mask.shape)}")
        self.mask = mask
        self._handles = []
        for layer, kept in enumerate(current):
            if not kept:
                continue
            block = adapter.attention_block(model, layer)
            index = torch.tensor(kept, dtype=torch.long)
            hook = self._make_hook(layer, index, block.head_dim)
            self._handles.append(block.output.register_forward_pre_hook(hook))

    def _make_hook(self, layer: int, index: torch.Tensor, head_dim: int):
        def hook(module: nn.Module, args: tuple) -> tuple:
            (x, *rest) = args
            scale = self.mask[layer, index].to(device=x.device, dtype=x.dtype)
            shaped = x.unflatten(-1, (index.numel(), head_dim)) * scale[:, None]
            return (shaped.flatten(-2), *rest)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> HeadAblation:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@contextmanager
def ablate(model: nn.Module, heads: HeadSet) -> Iterator[HeadAblation]:
    """Within the block, ``model`` behaves as if only ``heads`` were kept (others masked to 0)."""
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    mask = torch.tensor(heads.mask(original), dtype=torch.float32)
    with HeadAblation(model, mask) as ablation:
        yield ablation
