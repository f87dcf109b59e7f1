"""The greedy removal order of circuit extraction (`CircuitOrder`, its JSON form) and the
refusals of bad extraction arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ...errors import InputError
from ...heads import HeadSet
from ...saving.files import atomic_write_json

Objective = Literal["acc", "ood", "avg"]


OBJECTIVES = ("acc", "ood", "avg")


Head = tuple[int, int]


class CircuitError(InputError):
    """Bad arguments to circuit extraction."""


@dataclass
class CircuitOrder:
    """The greedy removal order and the objective after each removal."""

    objective: str
    original_heads_per_layer: list[int]
    base_score: float
    removed: list[Head] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    approximation: dict[str, Any] | None = None
    """``None`` for the exact algorithm; the lazy mode's settings otherwise."""

    def head_set(self, num_pruned: int | None = None) -> HeadSet:
        """The heads kept after pruning the first ``num_pruned`` heads of the order (all of them
        by default)."""
        n = len(self.removed) if num_pruned is None else num_pruned
        if not 0 <= n <= len(self.removed):
            raise CircuitError(f"num_pruned must be in [0, {len(self.removed)}], got {n}")
        return HeadSet.without(self.removed[:n], self.original_heads_per_layer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "heads_per_layer": list(self.original_heads_per_layer),  # the file key of every version
            "base_score": self.base_score,
            "removed": [list(h) for h in self.removed],
            "scores": list(self.scores),
            **({"approximation": dict(self.approximation)} if self.approximation else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CircuitOrder:
        """An order read back from JSON; CircuitError where it names a head outside
        ``original_heads_per_layer`` or one head twice (a damaged or edited file)."""
        order = cls(
            objective=data["objective"],
            original_heads_per_layer=[int(n) for n in data["heads_per_layer"]],
            base_score=float(data["base_score"]),
            removed=[(int(a), int(b)) for a, b in data["removed"]],
            scores=[float(s) for s in data["scores"]],
            approximation=data.get("approximation"),
        )
        heads, seen = order.original_heads_per_layer, set()
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


def removal_ranking(order: CircuitOrder) -> np.ndarray:
    """(layers, heads) array: the step at which each head was removed (inf if never)."""
    out = np.full((len(order.original_heads_per_layer), max(order.original_heads_per_layer)), np.inf)
    for step, (layer, head) in enumerate(order.removed):
        out[layer, head] = step
    return out
