"""The cost/quality frontier of a sweep, and the configuration chosen within a budget.

Quality is what the held-out validation data measure: the flag's OOD AUROC where OOD validation
data were given (higher is better), else the NLL (lower is better). Cost is the latency ratio to
the single model at the largest batch size, measured side by side in the same run. A
configuration is on the frontier when no other is at least as cheap and at least as good, and
better in one of the two. Within a budget, a candidate replaces the single model only where its
paired interval shows it significantly better on the measure preferred and significantly worse on
no other (`choose`); a gain inside the noise keeps the single model. Nothing here reads an OOD
test set: the sweep has none.
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


def significance(row: Row, metric: str) -> int:
    """+1 where ``row`` is significantly better than the single model on ``metric`` (its paired 95%
    interval, ``<metric>_vs_single_low``/``_high``, excludes 0 on the better side), -1 where
    significantly worse, 0 inside the noise (and for the single model itself)."""
    low, high = row.get(f"{metric}_vs_single_low"), row.get(f"{metric}_vs_single_high")
    if low is None or high is None or low == high == 0:
        return 0
    higher = metric == "auroc"
    if (low > 0) if higher else (high < 0):
        return 1
    if (high < 0) if higher else (low > 0):
        return -1
    return 0


def choose(rows: Sequence[Row], budget: float, cost: str = "latency_ratio", prefer: str | None = None) -> int:
    """The index of the configuration the budget rule chooses: among those within ``budget``, a
    candidate may replace the single model (row 0) only where it is significantly better on the
    ``prefer``red measure (default: the flag's AUROC where measured, else the NLL) and
    significantly worse on no other (`significance`); of those, the best on that measure (ties:
    the lower NLL, then the lower cost). Without one, the single model. InputError where nothing
    is within ``budget``."""
    key, higher = quality_key(rows) if prefer is None else (prefer, prefer == "auroc")
    if key == "auroc" and quality_key(rows)[0] != "auroc":
        raise InputError("--prefer auroc needs the flag's AUROC: give OOD validation data (--ood-data)")
    within = [i for i, r in enumerate(rows) if float(r[cost]) <= budget]
    if not within:
        cheapest = min(float(r[cost]) for r in rows)
        raise InputError(
            f"no configuration is within {budget:g}x the single model's latency (the cheapest is "
            f"{cheapest:.2f}x): raise --budget"
        )
    others = [m for m in ("auroc", "nll") if m != key and f"{m}_vs_single_low" in rows[0]]
    winners = [
        i
        for i in within
        if i > 0 and significance(rows[i], key) > 0 and all(significance(rows[i], m) >= 0 for m in others)
    ]
    if not winners:
        return 0
    return max(
        winners, key=lambda i: (_better(rows[i], key, higher), -float(rows[i]["nll"]), -float(rows[i][cost]))
    )


def verdict(rows: Sequence[Row], chosen: int, budget: float, prefer: str | None = None) -> str:
    """One line saying what the choice rests on: the chosen candidate's differences from the
    single model, or why the single model is kept."""
    key = quality_key(rows)[0] if prefer is None else prefer
    label = {"auroc": "flag AUROC", "nll": "NLL"}

    def differences(row: Row) -> str:
        return ", ".join(
            f"{label[m]} {row[f'{m}_vs_single']:+.3f} [{row[f'{m}_vs_single_low']:+.3f}, "
            f"{row[f'{m}_vs_single_high']:+.3f}]"
            for m in ("auroc", "nll")
            if f"{m}_vs_single" in row
        )

    if chosen:
        return (
            f"{rows[chosen]['name']} is chosen within {budget:g}x: significantly better than the single "
            f"model on {label[key]} and significantly worse on nothing ({differences(rows[chosen])})"
        )
    within = [r for r in rows[1:] if float(r["latency_ratio"]) <= budget]
    if not within:
        return f"the single model is kept: no ensemble is within {budget:g}x its latency"
    best = max(within, key=lambda r: _better(r, key, key == "auroc"))
    return (
        f"the single model is kept: no candidate within {budget:g}x is significantly better on "
        f"{label[key]} without being significantly worse on another measure (the best on "
        f"{label[key]}, {best['name']}: {differences(best)}): on this data an ensemble does not earn its cost"
    )
