"""Greedy circuit extraction (paper Algorithm 1, Appendix D.1.2).

Repeat ``budget`` times: for every remaining head, ablate it temporarily (zero its W_O column
block, here by masking its output before W_O), score the objective S on validation data, restore;
then ablate for good the head whose removal leaves the highest S. S is ID accuracy (``acc``),
MSP AUROC between ID and OOD validation data (``ood``), or their mean (``avg``). Ties in S
(frequent: accuracy and AUROC saturate) are broken by a continuous companion score
(`tie_break_value`), then by head index.

Two implementations return the same order:

* ``method="reference"``: the plain algorithm, one full forward pass per candidate.
* ``method="fast"`` (default): exact accelerations. The hidden states entering every layer are
  computed once per step (ablating a head of layer l leaves layers < l unchanged), all of a
  layer's candidates run together as one candidate-stacked batch from that layer on, reusing
  that layer's Q/K/V and attention (identical for all its candidates: ablation acts after them)
  where the family exposes them (BERT), and where the classifier reads only [CLS] (BERT) the
  last layer runs W_O, LayerNorm and MLP for [CLS] only (`ArchitectureAdapter.first_token_only`).
  Across steps, candidates restart from their stored states above the layer of the last removal
  (`_SuffixCache`); for a dual encoder, the candidates of the tower the removal left untouched do
  not run at all: their stored tower output is scored against the other tower's new embeddings
  (`benchmarks/zero_shot_circuit_speed.py`; timings: docs/benchmarks.md).

An approximate mode, ``method="lazy"``, is for large models: after a full evaluation, the next
steps evaluate (with the fast path) only the ``shortlist`` candidates that scored best when last
evaluated, refreshing all scores every ``refresh_every`` steps (lazy greedy). It is not exact;
``benchmarks/circuit_speed.py`` reports its agreement with the exact order.

Candidate evaluations can be split across ``torch.distributed`` ranks; an interrupted extraction
resumes from its checkpoint file and ends with the same result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from ..adapters import ArchitectureAdapter, DualEncoderAdapter, get_adapter
from ..batching import checked_batches, model_inputs
from ..errors import InputError
from ..hashing import batches_digest, fingerprint, json_digest
from ..heads import HeadSet
from ..io import atomic_write_json, read_json
from ..metrics import auroc
from ..precision import Precision, in_precision, model_device, resolve_precision
from ..progress import progress_bar
from ..serialization import check_finite
from ..surgery import HeadAblation, kept_heads
from .forward import (
    capture_layer_inputs,
    capturing_layer_inputs,
    dual_logits,
    dual_tower_from_layer,
    replaying_core,
    run_from_layer,
)

Objective = Literal["acc", "ood", "avg"]
OBJECTIVES = ("acc", "ood", "avg")
Head = tuple[int, int]
UNKNOWN = (math.inf, math.inf)  # lazy mode: never-scored candidates are evaluated first


class CircuitError(InputError):
    """Bad arguments to circuit extraction."""


@dataclass
class CircuitOrder:
    """The greedy removal order and the objective after each removal."""

    objective: str
    heads_per_layer: list[int]
    base_score: float
    removed: list[Head] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    approximation: dict[str, Any] | None = None
    """``None`` for the exact algorithm; the lazy mode's settings otherwise."""

    def head_set(self, num_pruned: int | None = None, *, num_removed: int | None = None) -> HeadSet:
        """The heads kept after pruning the first ``num_pruned`` heads of the order (all of them
        by default). ``num_removed`` is the deprecated name of ``num_pruned``."""
        if num_removed is not None:
            warnings.warn("num_removed is deprecated: use num_pruned", DeprecationWarning, stacklevel=2)
            num_pruned = num_removed
        n = len(self.removed) if num_pruned is None else num_pruned
        if not 0 <= n <= len(self.removed):
            raise CircuitError(f"num_pruned must be in [0, {len(self.removed)}], got {n}")
        return HeadSet.without(self.removed[:n], self.heads_per_layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "heads_per_layer": list(self.heads_per_layer),
            "base_score": self.base_score,
            "removed": [list(h) for h in self.removed],
            "scores": list(self.scores),
            **({"approximation": dict(self.approximation)} if self.approximation else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CircuitOrder:
        """An order read back from JSON; CircuitError where it names a head outside
        ``heads_per_layer`` or one head twice (a damaged or edited file)."""
        order = cls(
            objective=data["objective"],
            heads_per_layer=[int(n) for n in data["heads_per_layer"]],
            base_score=float(data["base_score"]),
            removed=[(int(a), int(b)) for a, b in data["removed"]],
            scores=[float(s) for s in data["scores"]],
            approximation=data.get("approximation"),
        )
        heads, seen = order.heads_per_layer, set()
        for layer, head in order.removed:
            if not (0 <= layer < len(heads) and 0 <= head < heads[layer]) or (layer, head) in seen:
                raise CircuitError(
                    f"the order names head ({layer}, {head}) twice or outside its heads per layer {heads}"
                )
            seen.add((layer, head))
        return order

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> CircuitOrder:
        return cls.from_dict(json.loads(Path(path).read_text()))


def objective_value(
    objective: str, id_logits: torch.Tensor, id_labels: torch.Tensor, ood_logits: torch.Tensor | None
) -> float:
    """S for one set of logits: accuracy, MSP AUROC (OOD positive), or their mean."""
    acc = (id_logits.argmax(-1) == id_labels).double().mean().item()
    if objective == "acc":
        return acc
    msp_id = 1.0 - id_logits.double().softmax(-1).max(-1).values
    msp_ood = 1.0 - ood_logits.double().softmax(-1).max(-1).values
    separation = auroc(msp_id.numpy(), msp_ood.numpy())
    return separation if objective == "ood" else 0.5 * (acc + separation)


def tie_break_value(
    objective: str, id_logits: torch.Tensor, id_labels: torch.Tensor, ood_logits: torch.Tensor | None
) -> float:
    """A continuous companion of S, used only to order candidates whose S ties.

    Accuracy and AUROC saturate on small or easy validation sets (many candidates reach S = 1),
    and the plain algorithm would then remove heads in index order. Ties are broken by the ID
    log-likelihood (``acc``), the ID-minus-OOD mean confidence gap (``ood``), or their sum
    (``avg``), rounded to 6 decimals so float noise cannot reorder candidates.
    """
    log_probs = id_logits.double().log_softmax(-1)
    likelihood = log_probs.gather(-1, id_labels[:, None]).mean().item()
    if objective == "acc":
        return round(likelihood, 6)
    gap = (
        id_logits.double().softmax(-1).max(-1).values.mean()
        - ood_logits.double().softmax(-1).max(-1).values.mean()
    ).item()
    return round(gap if objective == "ood" else likelihood + gap, 6)


def _both(objective, id_logits, id_labels, ood_logits) -> tuple[float, float]:
    return (
        objective_value(objective, id_logits, id_labels, ood_logits),
        tie_break_value(objective, id_logits, id_labels, ood_logits),
    )


def objective_bounds(
    objective: str,
    id_logits: torch.Tensor,
    id_labels: torch.Tensor,
    ood_logits: torch.Tensor | None,
    error: float,
) -> tuple[float, float]:
    """The lowest and highest S that logits within ``error`` (each entry) of ``id_logits`` and
    ``ood_logits`` can have: how far a low-precision evaluation can be from the exact one.

    Accuracy: an example whose label logit leads every other by more than ``2 * error`` is
    correct either way, one that trails by more is wrong either way; the rest can go both ways.
    AUROC: a logit error of ``error`` moves every ``logit_j - max logit`` by at most ``2 * error``,
    so the maximum softmax probability p lies in ``[p e^(-2 error), p e^(2 error)]``; AUROC only
    falls as ID scores rise and OOD scores fall, so its bounds are the AUROCs of the extremes.
    """
    x = id_logits.double()
    label = x.gather(-1, id_labels[:, None])[:, 0]
    others = x.scatter(-1, id_labels[:, None], -math.inf).max(-1).values
    lead = label - others
    acc = ((lead > 2 * error).double().mean().item(), (lead >= -2 * error).double().mean().item())
    if objective == "acc":
        return acc

    def msp_range(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        p = logits.double().softmax(-1).max(-1).values
        low, high = p * math.exp(-2 * error), (p * math.exp(2 * error)).clamp(max=1.0)
        return (1.0 - high).numpy(), (1.0 - low).numpy()  # the OOD score 1 - p: low, high

    id_low, id_high = msp_range(id_logits)
    ood_low, ood_high = msp_range(ood_logits)
    separation = (auroc(id_high, ood_low), auroc(id_low, ood_high))
    if objective == "ood":
        return separation
    return 0.5 * (acc[0] + separation[0]), 0.5 * (acc[1] + separation[1])


class _CandidateMasks(HeadAblation):
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


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class CircuitConfig:
    """Every setting of a circuit extraction (`extract_circuit`), which `build.BuildConfig` and
    the command line pass through whole.

    ``objective``: what a removal keeps (``acc``, ``ood`` or their average ``avg``); ``budget``:
    heads to remove; ``min_heads_per_layer``: heads every layer keeps; ``method``: ``fast``
    (exact, with the suffix cache), ``reference`` (exact, plain) or ``lazy`` (approximate: only
    ``shortlist`` candidates per step between full evaluations every ``refresh_every`` steps);
    ``candidate_chunk``: candidates evaluated per stacked pass; ``cache_gb``: the memory of the
    fast path's cross-step reuse (0 turns it off; results are the same either way);
    ``precision`` and ``rescore``: see `extract_circuit`."""

    objective: Objective = "avg"
    budget: int = 24
    min_heads_per_layer: int = 0
    method: Literal["fast", "reference", "lazy"] = "fast"
    candidate_chunk: int = 16
    shortlist: int = 8
    refresh_every: int = 8
    cache_gb: float = 2.0
    precision: str = "auto"
    rescore: bool = True


def extract_circuit(
    model: nn.Module,
    id_val: Iterable[dict[str, Any]],
    ood_val: Iterable[dict[str, Any]] | None = None,
    config: CircuitConfig | None = None,
    *,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    **settings: Any,
) -> CircuitOrder:
    """Greedy circuit extraction: remove ``budget`` heads, one per step, best-S first.

    ``id_val`` and ``ood_val`` are iterables of model-input batches (``id_val`` with ``labels``);
    ``ood_val`` is a *validation* OOD set, never a test set. ``min_heads_per_layer`` keeps at least
    that many heads in every layer. ``checkpoint`` (a JSON path) makes the run resumable.
    ``method="lazy"`` (approximate) evaluates only ``shortlist`` candidates per step between full
    evaluations every ``refresh_every`` steps. ``cache_gb`` caps the memory of the fast path's
    cross-step reuse (hidden states per candidate; 0 turns it off; results are the same either way).
    ``precision``: candidates are scored on a copy of the model cast to it where the model's
    dtype differs (`precision.resolve_precision`; ``auto`` is bf16 only where it is native). In
    bf16 or fp16, every candidate that could be the best once rounding is accounted for
    (`objective_bounds`, with twice the largest logit error seen between the two precisions) is
    scored again in fp32, and the choice is made on the fp32 scores: the order is fp32's
    (`_ExactRescoring`). fp32 gives the same order on every path (fast, reference).
    ``rescore=False`` skips that: the low-precision order, faster, but near-ties are decided by
    the machine's rounding (`benchmarks/circuit_speed.py --precisions` measures both).
    ``config`` (`CircuitConfig`) holds the settings; keyword ``settings`` replace single fields
    of it (``extract_circuit(model, val, ood, budget=12)``).
    """
    if config is not None and not isinstance(config, CircuitConfig):
        raise TypeError(f"config must be a CircuitConfig (settings by keyword), got {config!r:.40}")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(CircuitConfig)})
    if unknown:
        raise TypeError(f"extract_circuit has no setting {unknown[0]!r}")
    config = dataclasses.replace(config or CircuitConfig(), **settings)
    objective, budget, min_heads_per_layer = config.objective, config.budget, config.min_heads_per_layer
    method, candidate_chunk, cache_gb = config.method, config.candidate_chunk, config.cache_gb
    lazy = _lazy_settings(objective, method, config.shortlist, config.refresh_every)
    adapter = get_adapter(model)
    heads_per_layer = adapter.original_heads_per_layer(model)
    id_batches, ood_batches = _checked_inputs(model, heads_per_layer, id_val, ood_val, objective)
    _check_budget(heads_per_layer, budget, min_heads_per_layer)
    compute = resolve_precision(config.precision, model_device(model))
    rescore = config.rescore and compute.reduced
    exact_model = in_precision(model, Precision("fp32", "exact re-scoring")) if rescore else None
    model = in_precision(model, compute)
    name = f"{compute.name}, fp32 re-scoring" if rescore else compute.name
    settings = [name, objective, min_heads_per_layer, *([lazy] if lazy else [])]
    key = _run_key(model, settings, id_batches, ood_batches)  # exact methods share checkpoints
    was_training = model.training
    model.eval()
    cache = _SuffixCache(_last_layers(adapter, heads_per_layer), cache_gb * 2**30)
    masks = _CandidateMasks(model)
    exact = None
    if exact_model is not None:
        exact_cache = _SuffixCache(_last_layers(adapter, heads_per_layer), cache_gb * 2**30)
        exact = _ExactRescoring(exact_model, adapter, masks, method, candidate_chunk, exact_cache)
    run = _Extraction(
        model, adapter, masks, heads_per_layer, id_batches,
        ood_batches, objective, min_heads_per_layer, method, candidate_chunk, lazy,
        None if method == "reference" else cache, exact,
    )  # fmt: skip
    try:
        order = run.extract(budget, checkpoint, key, progress)
    finally:
        run.masks.remove()
        if exact is not None:
            exact.close()
        model.train(was_training)
    order.removed, order.scores = order.removed[:budget], order.scores[:budget]
    return order


def _lazy_settings(objective: str, method: str, shortlist: int, refresh_every: int) -> dict[str, Any] | None:
    """The lazy method's settings (part of the checkpoint key), None for the exact methods."""
    if objective not in OBJECTIVES:
        raise CircuitError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if method not in ("fast", "reference", "lazy"):
        raise CircuitError(f"method must be 'fast', 'reference' or 'lazy', got {method!r}")
    if method != "lazy":
        return None
    if shortlist < 1 or refresh_every < 1:
        raise CircuitError("lazy extraction needs shortlist >= 1 and refresh_every >= 1")
    return {"method": "lazy", "shortlist": shortlist, "refresh_every": refresh_every}


def _checked_inputs(model, heads_per_layer, id_val, ood_val, objective) -> tuple[list[dict], list[dict]]:
    """ID batches (labelled within the model's classes) and OOD batches, for an unpruned model."""
    if kept_heads(model).resolve(heads_per_layer) != HeadSet.full(heads_per_layer).resolve(heads_per_layer):
        raise CircuitError("extract circuits from an unpruned model; prune with the resulting head sets")
    check_finite(model.named_parameters(), "the model", CircuitError)
    id_batches = checked_batches(
        id_val or [], "id_val", int(model.config.num_labels), CircuitError, model=model
    )
    ood_batches = (
        [] if ood_val is None else checked_batches(ood_val, "ood_val", error=CircuitError, model=model)
    )
    if objective in ("ood", "avg") and not ood_batches:
        raise CircuitError(f"objective {objective!r} needs OOD validation data (ood_val)")
    return id_batches, ood_batches


def _check_budget(heads_per_layer: list[int], budget: int, min_heads_per_layer: int) -> None:
    total, fewest = sum(heads_per_layer), min(heads_per_layer)
    if min_heads_per_layer < 0 or min_heads_per_layer > fewest:
        raise CircuitError(
            f"min_heads_per_layer={min_heads_per_layer} is impossible: layers have {fewest} heads"
        )
    removable = total - sum(min(min_heads_per_layer, h) for h in heads_per_layer)
    if not 0 <= budget <= removable:
        raise CircuitError(
            f"budget {budget} out of range: at most {removable} of {total} heads can be removed"
            + (f" with min_heads_per_layer={min_heads_per_layer}" if min_heads_per_layer else "")
        )


def _run_key(model: nn.Module, settings: list, id_batches: list[dict], ood_batches: list[dict]) -> str:
    """What a checkpoint must match to be resumed: the model, settings and data."""
    return json_digest(
        [
            fingerprint(model),
            *settings[:3],
            batches_digest(id_batches),
            batches_digest(ood_batches),
            *settings[3:],
        ]
    )


@dataclass
class _Extraction:
    """The greedy loop's fixed inputs; `extract` runs (or resumes) the steps."""

    model: nn.Module
    adapter: ArchitectureAdapter
    masks: _CandidateMasks
    heads_per_layer: list[int]
    id_batches: list[dict]
    ood_batches: list[dict]
    objective: str
    min_heads_per_layer: int
    method: str
    chunk: int
    lazy: dict[str, Any] | None
    cache: _SuffixCache | None
    exact: _ExactRescoring | None = None

    def extract(self, budget: int, checkpoint, key: str, progress: bool) -> CircuitOrder:
        id_labels = torch.cat([b["labels"] for b in self.id_batches])
        rank, world = _dist()
        order, known, since_refresh, error = _resume(checkpoint, key, self.objective, self.heads_per_layer)
        order.approximation = self.lazy
        for layer, head in order.removed:
            self.masks.mask[layer, head] = 0.0
        if order.removed == [] and math.isnan(order.base_score):
            logits = _all_logits(self.model, self.id_batches, self.ood_batches)
            if self.exact is not None:  # the unablated model in both precisions: a first error
                exact_logits = _all_logits(self.exact.model, self.id_batches, self.ood_batches)
                error = _logit_error(logits, exact_logits)
                logits = exact_logits
            order.base_score = objective_value(self.objective, logits[0], id_labels, logits[1])
        if self.exact is not None:
            self.exact.error = error
        bar = progress_bar(  # counts candidate evaluations, what a step's time is proportional to
            desc=f"circuit ({self.objective}, {budget} heads)",
            unit="candidate",
            enabled=progress and rank == 0,
        )
        while len(order.removed) < budget:
            candidates, since_refresh = self._candidates(known, since_refresh)
            bar.total = bar.n + self._work_left(len(candidates), budget - len(order.removed), since_refresh)
            bar.refresh()
            logits = self._logits(candidates, rank, world)
            scores = {c: _both(self.objective, ids, id_labels, oods) for c, (ids, oods) in logits.items()}
            choices = candidates
            if self.exact is not None:  # the best in fp32 is among the candidates scored again
                choices, exact = self.exact.rescore(self, candidates, logits, id_labels)
                scores.update(exact)
            best = max(choices, key=lambda c: (*scores[c], -candidates.index(c)))
            self.masks.mask[best] = 0.0
            for cache in (self.cache, self.exact and self.exact.cache):
                if cache is not None:
                    cache.removed(best)
            order.removed.append(best)
            order.scores.append(scores[best][0])
            if self.lazy:
                known = {c: v for c, v in {**known, **scores}.items() if c != best}
            if checkpoint is not None and rank == 0:
                self._save(checkpoint, key, order, known, since_refresh)
            bar.set_postfix(
                step=f"{len(order.removed)}/{budget}",
                S=f"{scores[best][0]:.4f}",
                removed=f"L{best[0]}H{best[1]}",
            )
            bar.update(len(candidates))
        bar.close()
        return order

    def _work_left(self, candidates: int, steps: int, since_refresh: int) -> int:
        """An estimate of the candidate evaluations of the ``steps`` steps left, this one's
        ``candidates`` first: one fewer each step (exact methods); the shortlist, and every head
        remaining at each refresh (lazy)."""
        if not self.lazy:
            return sum(max(candidates - j, 1) for j in range(steps))
        remaining = int((self.masks.mask > 0).sum())
        every = self.lazy["refresh_every"]
        refreshes = (since_refresh + steps) // (every + 1)
        return candidates + (steps - 1 - refreshes) * self.lazy["shortlist"] + refreshes * remaining

    def _candidates(self, known: dict, since_refresh: int) -> tuple[list[Head], int]:
        """Heads that may go next (every one, or lazily the best-known few) and the steps since
        the last full evaluation."""
        mask, floor = self.masks.mask, self.min_heads_per_layer
        candidates = [
            (layer, h)
            for layer, count in enumerate(self.heads_per_layer)
            for h in range(count)
            if mask[layer, h] > 0 and mask[layer].sum() > floor
        ]
        if not (self.lazy and known and since_refresh < self.lazy["refresh_every"]):
            return candidates, 1
        # best-known first, ties by index
        candidates = sorted(candidates, key=lambda c: (*known.get(c, UNKNOWN), -c[0], -c[1]), reverse=True)
        return sorted(candidates[: self.lazy["shortlist"]]), since_refresh + 1

    def _logits(self, candidates: list[Head], rank: int, world: int) -> dict[Head, tuple]:
        """(ID logits, OOD logits or None) of every candidate, this rank's share computed here."""
        logits = _evaluator(self.method)(
            self.model, self.adapter, self.masks, candidates[rank::world], self.id_batches,
            self.ood_batches, self.chunk, self.cache,
        )  # fmt: skip
        if world > 1:
            gathered: list[dict] = [None] * world  # type: ignore[list-item]
            torch.distributed.all_gather_object(gathered, logits)
            logits = {h: v for part in gathered for h, v in part.items()}
        return logits

    def _save(self, checkpoint, key: str, order: CircuitOrder, known: dict, since_refresh: int) -> None:
        state: dict[str, Any] = {"key": key, "order": order.to_dict()}
        if self.exact is not None:
            state["logit_error"] = self.exact.error
        if self.lazy:
            state["lazy"] = {
                "since_refresh": since_refresh,
                "known": [[*c, *v] for c, v in sorted(known.items())],
            }
        atomic_write_json(checkpoint, state)


def _resume(
    checkpoint, key: str, objective: str, heads_per_layer: list[int]
) -> tuple[CircuitOrder, dict[Head, tuple[float, float]], int, float]:
    """The order so far, (lazy mode) the last known candidate scores and steps since refresh,
    and (low precision) the largest logit error seen so far."""
    fresh = CircuitOrder(objective, list(heads_per_layer), base_score=float("nan"))
    if checkpoint is None or not Path(checkpoint).is_file():
        return fresh, {}, 0, 0.0
    try:
        data = read_json(checkpoint, "circuit checkpoint")
    except ValueError as exc:
        raise CircuitError(f"{exc}: delete it to start over") from None
    if not isinstance(data, dict) or "order" not in data:
        raise CircuitError(f"{checkpoint} is not a circuit checkpoint: delete it or choose another path")
    if data.get("key") != key:
        raise CircuitError(
            f"checkpoint {checkpoint} belongs to another extraction (model, data or settings differ, "
            "or an older release wrote it); delete it or choose another path"
        )
    try:
        lazy = data.get("lazy", {})
        known = {(int(a), int(b)): (float(v), float(t)) for a, b, v, t in lazy.get("known", [])}
        error = float(data.get("logit_error", 0.0))
        return CircuitOrder.from_dict(data["order"]), known, int(lazy.get("since_refresh", 0)), error
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CircuitError(f"checkpoint {checkpoint} is damaged ({exc}): delete it to start over") from None


@torch.no_grad()
def _all_logits(model, id_batches, ood_batches) -> tuple[torch.Tensor, torch.Tensor | None]:
    id_logits = torch.cat([model(**model_inputs(b)).logits.float() for b in id_batches])
    ood_logits = (
        torch.cat([model(**model_inputs(b)).logits.float() for b in ood_batches]) if ood_batches else None
    )
    return id_logits, ood_logits


def _evaluate_reference(model, adapter, masks, candidates, id_batches, ood_batches, _chunk, _cache=None):
    """The plain algorithm: ablate, run the whole model on all validation data, restore."""
    logits = {}
    for layer, head in candidates:
        masks.mask[layer, head] = 0.0
        logits[(layer, head)] = _all_logits(model, id_batches, ood_batches)
        masks.mask[layer, head] = 1.0
    return logits


@torch.no_grad()
def _evaluate_fast(model, adapter, masks, candidates, id_batches, ood_batches, chunk, cache=None):
    """Prefix caching + candidate-stacked batches (+ suffix reuse): exact, same order as the reference."""
    with adapter.first_token_only(model) or nullcontext():  # the last layer for [CLS] only, where exact
        logits = _run_candidates(model, adapter, masks, candidates, [*id_batches, *ood_batches], chunk, cache)
    if cache is not None:
        cache.refreshed(candidates)
    return {
        cand: (
            torch.cat(parts[: len(id_batches)]),
            torch.cat(parts[len(id_batches) :]) if ood_batches else None,
        )
        for cand, parts in logits.items()
    }


def _evaluator(method: str):
    """The candidate evaluation of an extraction method: the plain algorithm for ``reference``,
    the accelerated one (exact) for ``fast`` and ``lazy``."""
    return _evaluate_reference if method == "reference" else _evaluate_fast


def _logit_error(low: tuple, exact: tuple) -> float:
    """The largest absolute difference between two (ID, OOD or None) pairs of logits."""
    return max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(low, exact, strict=True) if a is not None
    )


ERROR_SAFETY = 2.0
"""`_ExactRescoring` bounds each logit's low-precision error by this times the largest error it
has seen between the two precisions (on the unablated model and every candidate scored twice)."""


class _ExactRescoring:
    """The fp32 side of a low-precision extraction.

    Each step, every candidate whose S could still be the best (its `objective_bounds` reach the
    highest lower bound of any candidate, with a logit error of ``ERROR_SAFETY`` x ``error``) is
    scored again on the fp32 model, with the same permanent masks; the step chooses among those on
    their fp32 scores. Where the fp32 logits show a larger error than the bound assumed, the bound
    grows and the set is widened until it is consistent. The true fp32 best is always in the set
    while the bound holds, so the order is fp32's; only the candidates near the top pay for fp32.
    """

    def __init__(
        self, model: nn.Module, adapter, masks: _CandidateMasks, method: str, chunk: int, cache: _SuffixCache
    ) -> None:
        self.model, self.was_training = model, model.training
        model.eval()
        self.adapter, self.method, self.chunk = adapter, method, chunk
        self.masks = _CandidateMasks(model)
        self.masks.mask = masks.mask  # one set of permanent masks: the low-precision model's
        self.cache = None if method == "reference" else cache
        """Its own cross-step reuse: the fp32 states of the candidates it scored."""
        self.error = 0.0
        self.rescored = 0
        """Candidate evaluations done in fp32 (what the low precision did not decide alone)."""

    def close(self) -> None:
        self.masks.remove()
        self.model.train(self.was_training)

    def rescore(self, run: _Extraction, candidates, logits, id_labels) -> tuple[list[Head], dict]:
        """The candidates scored again in fp32 (in their order) and their fp32 scores."""
        evaluate = _evaluator(self.method)
        exact: dict[Head, tuple[float, float]] = {}
        while True:
            bounds = {
                c: objective_bounds(run.objective, ids, id_labels, oods, ERROR_SAFETY * self.error)
                for c, (ids, oods) in logits.items()
            }
            floor = max(low for low, _ in bounds.values())
            todo = [c for c in candidates if bounds[c][1] >= floor and c not in exact]
            if not todo:
                break
            batches = run.id_batches, run.ood_batches
            fresh = evaluate(self.model, self.adapter, self.masks, todo, *batches, self.chunk, self.cache)
            self.rescored += len(todo)
            for cand, values in fresh.items():
                exact[cand] = _both(run.objective, values[0], id_labels, values[1])
                self.error = max(self.error, _logit_error(logits[cand], values))
        return [c for c in candidates if c in exact], exact


class _SuffixCache:
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


def _last_layers(adapter: ArchitectureAdapter, heads_per_layer: list[int]) -> list[int]:
    """Per layer, the last layer of its stack: the model's, or a dual encoder's tower's."""
    spans = getattr(adapter, "spans", None) or {"": range(len(heads_per_layer))}
    return [span[-1] for span in spans.values() for _ in span]


def _run_candidates(
    model, adapter, masks, candidates, batches, chunk, cache
) -> dict[Head, list[torch.Tensor]]:
    """Logits of every candidate on every batch (one tensor per batch, in batch order).

    Candidates run in candidate-stacked groups: those of one layer l from the prefix cache
    (layer l's input, its attention core replayed once, a per-candidate mask on its W_O), and those
    the suffix cache restarts above their own layer from their stored states. A dual encoder's
    candidates whose tower is unchanged since their last evaluation do not run (`_SuffixCache`).
    """
    num_layers = len(masks.mask)
    dual = isinstance(adapter, DualEncoderAdapter)
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
        layer_inputs, contexts = capture.layer_inputs, capture.contexts
        for cand in complete:  # its tower's output is current: score it against the other tower
            output = cache.outputs[cand][index]
            logits[cand].append(dual_logits(model, adapter, cand[0], output, capture.embeddings).float())
        for (start, own), members in sorted(groups.items()):
            for lo in range(0, len(members), chunk):
                group = members[lo : lo + chunk]
                replay = None
                if own:  # ablate each candidate's head in its own layer; share Q/K/V and attention
                    group_masks = masks.mask[start].repeat(len(group), 1)
                    group_masks[torch.arange(len(group)), torch.tensor([h for _, h in group])] = 0.0
                    masks.active = (start, group_masks)
                    hidden = layer_inputs[start]
                    hidden = hidden.repeat(len(group), *([1] * (hidden.dim() - 1)))
                    replay = contexts[start]  # one copy; the mask hook stacks it per candidate
                    masks.shared = replay is not None
                else:  # ablated below `start`: resume from the stored states, permanent masks only
                    hidden = torch.cat([cache.states[c][index][start] for c in group])
                keep = cache is not None and cache.enabled  # store this group's states for later steps
                try:
                    with (
                        capturing_layer_inputs(
                            model, adapter, range(start + 1, num_layers) if keep else ()
                        ) as captured,
                        replaying_core(model, adapter.attention_core_path(start), replay),
                    ):
                        if dual:
                            tower = dual_tower_from_layer(model, adapter, start, hidden, inputs)
                            out = dual_logits(model, adapter, start, tower, capture.embeddings).float()
                        else:
                            out = run_from_layer(model, adapter, start, hidden, inputs).float()
                finally:
                    masks.active, masks.shared = None, False
                states = {k: v.chunk(len(group)) for k, v in captured.items()}
                outputs = tower.chunk(len(group)) if dual else ()
                for r, (cand, rows) in enumerate(zip(group, out.chunk(len(group)), strict=True)):
                    logits[cand].append(rows)
                    if keep:
                        cache.store(cand, index, {k: v[r] for k, v in states.items()})
                        if dual:
                            cache.store_output(cand, index, outputs[r])
    return logits


def removal_ranking(order: CircuitOrder) -> np.ndarray:
    """(layers, heads) array: the step at which each head was removed (inf if never)."""
    out = np.full((len(order.heads_per_layer), max(order.heads_per_layer)), np.inf)
    for step, (layer, head) in enumerate(order.removed):
        out[layer, head] = step
    return out
