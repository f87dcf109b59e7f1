"""The greedy loop: one removal per step, checkpointed after each, resumed from a checkpoint, and
split across ``torch.distributed`` ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...adapters import ArchitectureAdapter
from ...progress import progress_bar
from ...saving.files import atomic_write_json, read_json
from .candidates import (
    CandidateMasks,
    SuffixCache,
    all_logits,
    evaluator,
)
from .objectives import objective_scores, objective_value
from .order import CircuitError, CircuitOrder, Head
from .rescoring import ExactRescoring, logit_error

UNKNOWN = (math.inf, math.inf)  # lazy mode: never-scored candidates are evaluated first


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


@dataclass
class Extraction:
    """The greedy loop's fixed inputs; `extract` runs (or resumes) the steps."""

    model: nn.Module
    adapter: ArchitectureAdapter
    masks: CandidateMasks
    original_heads_per_layer: list[int]
    id_batches: list[dict]
    ood_batches: list[dict]
    objective: str
    min_heads_per_layer: int
    method: str
    chunk: int
    lazy: dict[str, Any] | None
    cache: SuffixCache | None
    exact: ExactRescoring | None = None
    fp32_alone: bool = False
    """Low precision only: set once a step has scored again in fp32 most of its candidates
    (`rescoring.MOST`); every later step scores its candidates in fp32 alone, on the fp32
    side's model and cache. The order is fp32's either way (what the switch saves, and where:
    `rescoring.MOST`)."""

    def extract(self, budget: int, checkpoint, key: str, progress: bool) -> CircuitOrder:
        id_labels = torch.cat([b["labels"] for b in self.id_batches])
        rank, world = _dist()
        order, known, since_refresh, error, fp32_alone = _resume(
            checkpoint, key, self.objective, self.original_heads_per_layer
        )
        if fp32_alone and self.exact is not None:
            self._score_in_fp32_alone()
        order.approximation = self.lazy
        for layer, head in order.removed:
            self.masks.mask[layer, head] = 0.0
        if order.removed == [] and math.isnan(order.base_score):
            logits = all_logits(self.model, self.id_batches, self.ood_batches)
            if self.exact is not None:  # the unablated model in both precisions: a first error
                exact_logits = all_logits(self.exact.model, self.id_batches, self.ood_batches)
                error = logit_error(logits, exact_logits)
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
            scores = {
                c: objective_scores(self.objective, ids, id_labels, oods) for c, (ids, oods) in logits.items()
            }
            choices = candidates
            if self.exact is not None and not self.fp32_alone:  # the fp32 best is among those rescored
                choices = self._rescore(candidates, logits, scores, id_labels)
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

    def _rescore(self, candidates: list[Head], logits: dict, scores: dict, id_labels) -> list[Head]:
        """The candidates scored again in fp32, their fp32 scores put in ``scores``; past `MOST` of
        the step's candidates, the steps left score in fp32 alone."""
        batches = self.id_batches, self.ood_batches
        choices, exact = self.exact.rescore(self.objective, batches, candidates, logits, id_labels)
        scores.update(exact)
        if self.exact.most(len(choices), len(candidates)):
            self._score_in_fp32_alone()
        return choices

    def _score_in_fp32_alone(self) -> None:
        self.fp32_alone, self.cache = True, None  # the low precision's states are not read again

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
            for layer, count in enumerate(self.original_heads_per_layer)
            for h in range(count)
            if mask[layer, h] > 0 and mask[layer].sum() > floor
        ]
        if not (self.lazy and known and since_refresh < self.lazy["refresh_every"]):
            return candidates, 1
        # best-known first, ties by index
        candidates = sorted(candidates, key=lambda c: (*known.get(c, UNKNOWN), -c[0], -c[1]), reverse=True)
        return sorted(candidates[: self.lazy["shortlist"]]), since_refresh + 1

    def _logits(self, candidates: list[Head], rank: int, world: int) -> dict[Head, tuple]:
        """(ID logits, OOD logits or None) of every candidate, this rank's share computed here (in
        fp32 on the fp32 side once `fp32_alone` is set)."""
        side = self.exact if self.fp32_alone else self
        logits = evaluator(self.method)(
            side.model, self.adapter, side.masks, candidates[rank::world], self.id_batches,
            self.ood_batches, self.chunk, side.cache,
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
            state["fp32_alone"] = self.fp32_alone
        if self.lazy:
            state["lazy"] = {
                "since_refresh": since_refresh,
                "known": [[*c, *v] for c, v in sorted(known.items())],
            }
        atomic_write_json(checkpoint, state)


def _resume(
    checkpoint, key: str, objective: str, original_heads_per_layer: list[int]
) -> tuple[CircuitOrder, dict[Head, tuple[float, float]], int, float, bool]:
    """The order so far, (lazy mode) the last known candidate scores and steps since refresh,
    and (low precision) the largest logit error seen so far and whether the steps left score in
    fp32 alone."""
    fresh = CircuitOrder(objective, list(original_heads_per_layer), base_score=float("nan"))
    if checkpoint is None or not Path(checkpoint).is_file():
        return fresh, {}, 0, 0.0, False
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
        fp32_alone = data.get("fp32_alone", False)
        if not isinstance(fp32_alone, bool):
            raise TypeError(f"fp32_alone is {fp32_alone!r}")
        order = CircuitOrder.from_dict(data["order"])
        return order, known, int(lazy.get("since_refresh", 0)), error, fp32_alone
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CircuitError(f"checkpoint {checkpoint} is damaged ({exc}): delete it to start over") from None
