"""The cost/quality frontier of a sweep, and the configuration chosen within a budget.

Quality is what the held-out validation data measure: the flag's OOD AUROC where OOD validation
data were given (higher is better), else the NLL (lower is better). Cost is the latency ratio to
the single model at the largest batch size, measured side by side in the same run. A
configuration is on the frontier when no other is at least as cheap and at least as good, and
better in one of the two. Within a budget, the rule chooses the best quality; ties go to the lower
NLL, then the lower cost. Nothing here reads an OOD test set: the sweep has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InputError

Row = Mapping[str, Any]


def quality_key(rows: Sequence[Row]) -> tuple[str, bool]:
    """The metric the frontier and the choice rank by, and whether higher is better: ``auroc``
    where every row has one, else ``nll``."""
    if rows and all(r.get("auroc") is not None for r in rows):
        return "auroc", True
    return "nll", False


def _better(row: Row, key: str, higher: bool) -> float:
    """``row``'s quality as a number where larger is better."""
    return float(row[key]) if higher else -float(row[key])


def frontier(rows: Sequence[Row], cost: str = "latency_ratio", quality: str | None = None) -> list[bool]:
    """For each row, whether it is on the cost/quality frontier (see the module docstring), or on
    the frontier of another ``quality`` (``auroc``: higher is better; ``nll``: lower)."""
    key, higher = quality_key(rows) if quality is None else (quality, quality == "auroc")
    points = [(float(r[cost]), _better(r, key, higher)) for r in rows]
    on = []
    for c, q in points:
        dominated = any(oc <= c and oq >= q and (oc < c or oq > q) for oc, oq in points)
        on.append(not dominated)
    return on


def choose(rows: Sequence[Row], budget: float, cost: str = "latency_ratio") -> int:
    """The index of the configuration the budget rule chooses (see the module docstring);
    InputError where none is within ``budget``."""
    key, higher = quality_key(rows)
    within = [i for i, r in enumerate(rows) if float(r[cost]) <= budget]
    if not within:
        cheapest = min(float(r[cost]) for r in rows)
        raise InputError(
            f"no configuration is within {budget:g}x the single model's latency (the cheapest is "
            f"{cheapest:.2f}x): raise --budget"
        )
    return max(
        within, key=lambda i: (_better(rows[i], key, higher), -float(rows[i]["nll"]), -float(rows[i][cost]))
    )
