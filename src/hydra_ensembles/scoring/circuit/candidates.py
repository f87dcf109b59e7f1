"""Evaluating candidate removals: the per-candidate masks, the plain (reference) and the accelerated
(fast) evaluation behind one interface (`evaluator`), and the cross-step suffix cache."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from ...adapters import ArchitectureAdapter
from ...batching import model_inputs
from ...surgery import HeadAblation
from ..forward import capture_layer_inputs, capturing_layer_inputs, replaying_core
from .order import Head


class CandidateMasks(HeadAblation):
    """`HeadAblation` (the permanent mask, ``mask``) plus per-candidate masks in one layer.

    With candidates active on layer l (``active = (l, masks)``, masks (R, H)), the batch is
    candidate-stacked (R groups of rows) and group r uses ``masks[r]`` as layer l's mask. With
    ``shared``, layer l's W_O input is one copy for all candidates (a replayed attention core) and
    the masks stack it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.active: tuple[int, torch.Tensor] | None = None
        self.shared = False
        super().__init__(model)

    def _make_hook(self, layer: int, index: torch.Tensor, head_dim: int):
        permanent = super()._make_hook(layer, index, head_dim)

        def hook(module: nn.Module, args: tuple) -> tuple:
            if self.active is None or self.active[0] != layer:
                return permanent(module, args)
            x, *rest = args
            masks = self.active[1][:, index].to(device=x.device, dtype=x.dtype)  # (R, kept heads)
            heads = x.unflatten(-1, (index.numel(), head_dim))
            grouped = heads[None] if self.shared else heads.unflatten(0, (masks.shape[0], -1))
            shape = (masks.shape[0],) + (1,) * (grouped.dim() - 3) + (index.numel(), 1)
            return ((grouped * masks.reshape(shape)).flatten(0, 1).flatten(-2), *rest)

        return hook


@torch.no_grad()
def all_logits(model, id_batches, ood_batches) -> tuple[torch.Tensor, torch.Tensor | None]:
    id_logits = torch.cat([model(**model_inputs(b)).logits.float() for b in id_batches])
    ood_logits = (
        torch.cat([model(**model_inputs(b)).logits.float() for b in ood_batches]) if ood_batches else None
    )
    return id_logits, ood_logits


def evaluate_reference(model, adapter, masks, candidates, id_batches, ood_batches, _chunk, _cache=None):
    """The plain algorithm: ablate, run the whole model on all validation data, restore."""
    logits = {}
    for layer, head in candidates:
        masks.mask[layer, head] = 0.0
        logits[(layer, head)] = all_logits(model, id_batches, ood_batches)
        masks.mask[layer, head] = 1.0
    return logits


@torch.no_grad()
def evaluate_fast(model, adapter, masks, candidates, id_batches, ood_batches, chunk, cache=None):
    """Prefix caching + candidate-stacked batches (+ suffix reuse): exact, same order as the reference."""
    with adapter.first_token_only(model) or nullcontext():  # the last layer for [CLS] only, where exact
        logits = run_candidates(model, adapter, masks, candidates, [*id_batches, *ood_batches], chunk, cache)
    if cache is not None:
        cache.refreshed(candidates)
    return {
        cand: (
            torch.cat(parts[: len(id_batches)]),
            torch.cat(parts[len(id_batches) :]) if ood_batches else None,
        )
        for cand, parts in logits.items()
    }


def evaluator(method: str):
    """The candidate evaluation of an extraction method: the plain algorithm for ``reference``,
    the accelerated one (exact) for ``fast`` and ``lazy``."""
    return evaluate_reference if method == "reference" else evaluate_fast


class SuffixCache:
    """Per candidate and validation batch: the hidden states entering the layers above the
    candidate's own, from its last evaluation (cross-step reuse, exact).

    Removing a head of layer l* for good changes nothing below l*, so a candidate of a layer
    l < l* enters l* in the next step exactly as it did in this one: it restarts there, and all
    such candidates share the permanent masks from l* on (one stacked batch, no per-candidate
    mask). ``valid[c]`` is the deepest layer whose entering state is still current. Stored bytes
    are capped by ``limit_bytes``; past it the cache empties and switches itself off (exact
    either way, only slower).

    A dual encoder's towers do not feed each other: removing a head of one tower leaves every
    state of the other tower's candidates current, down to the tower's output (input embeddings
    or class embeddings, ``outputs``). Such ``complete`` candidates are not run at all; their
    stored output is scored against the other tower's new embeddings.
    """

    def __init__(self, last_layers: list[int], limit_bytes: float) -> None:
        self.last_layers = last_layers
        """Per layer, the last layer its candidates' states can reach (the end of its tower)."""
        self.limit_bytes = limit_bytes
        self.enabled = limit_bytes > 0
        self.states: dict[Head, dict[int, dict[int, torch.Tensor]]] = {}  # cand -> batch -> layer
        self.valid: dict[Head, int] = {}
        self.outputs: dict[Head, dict[int, torch.Tensor]] = {}  # cand -> batch -> tower output
        self.complete: set[Head] = set()
        self.bytes = 0

    def start_layer(self, cand: Head) -> int:
        """The layer candidate ``cand`` must be run from in this step."""
        return max(cand[0], self.valid.get(cand, cand[0]))

    def store(self, cand: Head, batch: int, captured: dict[int, torch.Tensor]) -> None:
        if not self.enabled:
            return
        per_batch = self.states.setdefault(cand, {}).setdefault(batch, {})
        for layer, state in captured.items():
            self._put(per_batch, layer, state)

    def store_output(self, cand: Head, batch: int, output: torch.Tensor) -> None:
        """The output of ``cand``'s tower on ``batch`` (a dual encoder's candidates only)."""
        if self.enabled:
            self._put(self.outputs.setdefault(cand, {}), batch, output)

    def _put(self, where: dict, key: int, tensor: torch.Tensor) -> None:
        if key in where:
            self.bytes -= where[key].nbytes
        where[key] = tensor
        self.bytes += tensor.nbytes
        if self.bytes > self.limit_bytes:  # stop storing; emptied once this evaluation is over
            self.enabled = False

    def refreshed(self, candidates: Sequence[Head]) -> None:
        """``candidates`` were just evaluated on every batch: all their stored states are current."""
        if self.enabled:
            self.valid.update({c: self.last_layers[c[0]] for c in candidates if c in self.states})
            self.complete.update(c for c in candidates if c in self.outputs)
        else:
            self.states, self.valid, self.outputs, self.complete, self.bytes = {}, {}, {}, set(), 0

    def removed(self, head: Head) -> None:
        """``head`` was ablated for good: states of its tower entering layers above its layer are
        stale (the other tower's are not)."""
        for store in (self.states, self.valid, self.outputs):
            store.pop(head, None)
        tower = self.last_layers[head[0]]
        self.complete = {c for c in self.complete if c != head and self.last_layers[c[0]] != tower}
        self.valid = {
            c: min(v, head[0]) if self.last_layers[c[0]] == tower else v for c, v in self.valid.items()
        }


def last_layers(adapter: ArchitectureAdapter) -> list[int]:
    """Per layer, the last layer of its stack: the model's, or a dual encoder's tower's."""
    return [span[-1] for span in adapter.spans.values() for _ in span]


def _group_inputs(masks, capture, cache, group: list[Head], start: int, own: bool, index: int):
    """The stacked hidden states a group of candidates runs from at layer ``start`` and the
    attention core to replay (None: none). In their own layer (``own``) each candidate's head is
    masked on a copy of the layer's input, sharing its Q/K/V and attention (``masks.active``);
    ablated below ``start``, they resume from their stored states with their permanent masks."""
    if not own:
        return torch.cat([cache.states[c][index][start] for c in group]), None
    group_masks = masks.mask[start].repeat(len(group), 1)
    group_masks[torch.arange(len(group)), torch.tensor([h for _, h in group])] = 0.0
    masks.active = (start, group_masks)
    hidden = capture.layer_inputs[start]
    hidden = hidden.repeat(len(group), *([1] * (hidden.dim() - 1)))
    replay = capture.contexts[start]  # one copy; the mask hook stacks it per candidate
    masks.shared = replay is not None
    return hidden, replay


def run_candidates(
    model, adapter, masks, candidates, batches, chunk, cache
) -> dict[Head, list[torch.Tensor]]:
    """Logits of every candidate on every batch (one tensor per batch, in batch order).

    Candidates run in candidate-stacked groups: those of one layer l from the prefix cache
    (layer l's input, its attention core replayed once, a per-candidate mask on its W_O), and those
    the suffix cache restarts above their own layer from their stored states. A dual encoder's
    candidates whose tower is unchanged since their last evaluation do not run (`SuffixCache`).
    """
    num_layers = len(masks.mask)
    towers = len(adapter.spans) > 1  # stacks that do not feed each other: outputs worth keeping
    complete = [c for c in candidates if cache is not None and c in cache.complete]
    starts = {c: (cache.start_layer(c) if cache is not None else c[0]) for c in candidates}
    groups: dict[tuple[int, bool], list[Head]] = {}
    for cand in candidates:
        if cand not in complete:
            groups.setdefault((starts[cand], starts[cand] == cand[0]), []).append(cand)
    logits: dict[Head, list[torch.Tensor]] = {c: [] for c in candidates}
    for index, batch in enumerate(batches):
        inputs = model_inputs(batch)
        capture = capture_layer_inputs(model, adapter, inputs)
        for cand in complete:  # its tower's output is current: score it against the other tower
            output = cache.outputs[cand][index]
            logits[cand].append(adapter.logits_from_stack(model, cand[0], output, capture.embeddings).float())
        for (start, own), members in sorted(groups.items()):
            for lo in range(0, len(members), chunk):
                group = members[lo : lo + chunk]
                hidden, replay = _group_inputs(masks, capture, cache, group, start, own, index)
                keep = cache is not None and cache.enabled  # store this group's states for later steps
                try:
                    with (
                        capturing_layer_inputs(
                            model, adapter, range(start + 1, num_layers) if keep else ()
                        ) as captured,
                        replaying_core(model, adapter.attention_core_path(start), replay),
                    ):
                        tower = adapter.stack_from_layer(model, start, hidden, inputs)
                        out = adapter.logits_from_stack(model, start, tower, capture.embeddings).float()
                finally:
                    masks.active, masks.shared = None, False
                states = {k: v.chunk(len(group)) for k, v in captured.items()}
                outputs = tower.chunk(len(group)) if towers else ()
                for r, (cand, rows) in enumerate(zip(group, out.chunk(len(group)), strict=True)):
                    logits[cand].append(rows)
                    if keep:
                        cache.store(cand, index, {k: v[r] for k, v in states.items()})
                        if towers:
                            cache.store_output(cand, index, outputs[r])
    return logits
