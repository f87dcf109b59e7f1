"""The fp32 side of a low-precision extraction: candidates that rounding could have misordered are
scored again in fp32, so the order is fp32's."""

from __future__ import annotations

from torch import nn

from .candidates import (
    CandidateMasks,
    SuffixCache,
    evaluator,
)
from .objectives import objective_bounds, objective_scores
from .order import Head


def logit_error(low: tuple, exact: tuple) -> float:
    """The largest absolute difference between two (ID, OOD or None) pairs of logits."""
    return max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(low, exact, strict=True) if a is not None
    )


ERROR_SAFETY = 2.0
"""`ExactRescoring` bounds each logit's low-precision error by this times the largest error it
has seen between the two precisions (on the unablated model and every candidate scored twice)."""


MOST = 0.5
"""Once one step scores again in fp32 more than this share of its candidates, the extraction's
later steps score every candidate in fp32 alone (`Extraction.fp32_alone`). A step in the low
precision costs a pass over every candidate and an fp32 pass over those rescored: past this share,
more than fp32 alone wherever the low precision is under twice as fast as fp32, and at most a
tenth less where it is 2.5 times as fast (bf16 with AMX, docs/precision.md). The order is fp32's
either way; this share sets only the cost."""


class ExactRescoring:
    """The fp32 side of a low-precision extraction.

    Each step, every candidate whose S could still be the best (its `objective_bounds` reach the
    highest lower bound of any candidate, with a logit error of ``ERROR_SAFETY`` x ``error``) is
    scored again on the fp32 model, with the same permanent masks; the step chooses among those on
    their fp32 scores. Where the fp32 logits show a larger error than the bound assumed, the bound
    grows and the set is widened until it is consistent. The true fp32 best is always in the set
    while the bound holds, so the order is fp32's; only the candidates near the top pay for fp32.
    Where most of them are near the top (`MOST`: few validation texts, whose accuracy and AUROC
    tie often; bf16's coarse rounding), the extraction scores its later steps in fp32 alone.
    """

    def __init__(
        self, model: nn.Module, adapter, masks: CandidateMasks, method: str, chunk: int, cache: SuffixCache
    ) -> None:
        self.model, self.was_training = model, model.training
        model.eval()
        self.adapter, self.method, self.chunk = adapter, method, chunk
        self.masks = CandidateMasks(model)
        self.masks.mask = masks.mask  # one set of permanent masks: the low-precision model's
        self.cache = None if method == "reference" else cache
        """Its own cross-step reuse: the fp32 states of the candidates it scored."""
        self.error = 0.0
        self.rescored = 0
        """Candidate evaluations scored again in fp32 (what the low precision did not decide alone;
        not those of the steps scored in fp32 alone)."""

    @staticmethod
    def most(rescored: int, candidates: int) -> bool:
        """Whether a step that scored again ``rescored`` of its ``candidates`` scored most of
        them twice (`MOST`)."""
        return rescored > MOST * candidates

    def close(self) -> None:
        self.masks.remove()
        self.model.train(self.was_training)

    def rescore(
        self, objective: str, batches: tuple[list[dict], list[dict]], candidates, logits, id_labels
    ) -> tuple[list[Head], dict]:
        """The candidates scored again in fp32 (in their order) and their fp32 scores, on the ID
        and OOD validation ``batches``."""
        evaluate = evaluator(self.method)
        exact: dict[Head, tuple[float, float]] = {}
        while True:
            bounds = {
                c: objective_bounds(objective, ids, id_labels, oods, ERROR_SAFETY * self.error)
                for c, (ids, oods) in logits.items()
            }
            floor = max(low for low, _ in bounds.values())
            todo = [c for c in candidates if bounds[c][1] >= floor and c not in exact]
            if not todo:
                break
            fresh = evaluate(self.model, self.adapter, self.masks, todo, *batches, self.chunk, self.cache)
            self.rescored += len(todo)
            for cand, values in fresh.items():
                exact[cand] = objective_scores(objective, values[0], id_labels, values[1])
                self.error = max(self.error, logit_error(logits[cand], values))
        return [c for c in candidates if c in exact], exact
