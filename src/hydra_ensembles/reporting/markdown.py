"""The report's building blocks: values formatted (percentages, signed differences, intervals),
Markdown tables, the best value of a column marked, the OOD score a row is shown with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PERCENT = {"acc", "ece", "aece", "aurc", "auroc", "fpr95", "aupr_in", "aupr_out"}
"""The measures shown as percentages."""


def format_value(key: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.2f}" if key in PERCENT else f"{value:.3f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: one header row, a separator, one line per row (cells as given)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def bold_best(values: dict[str, dict[str, float]], columns) -> dict[str, dict[str, str]]:
    out = {m: {} for m in values}
    for key, _, higher in columns:
        present = [v[key] for v in values.values() if key in v]
        best = (max if higher else min)(present) if present else None
        for method, v in values.items():
            text = format_value(key, v.get(key))
            out[method][key] = f"**{text}**" if key in v and v[key] == best and len(present) > 1 else text
    return out


def signed(key: str, value: float) -> str:
    return f"{100 * value:+.2f}" if key in PERCENT else f"{value:+.3f}"


def difference(key: str, d: Mapping[str, float] | None) -> str:
    """A paired difference as ``+1.23 [+0.10, +2.30] p=0.03 *``."""
    if d is None:
        return "–"
    star = " *" if d["p_value"] < 0.05 else ""
    interval = f"[{signed(key, d['low'])}, {signed(key, d['high'])}]"
    return f"{signed(key, d['difference'])} {interval} p={d['p_value']:.2f}{star}"


def row_score(result: Mapping[str, Any], score: str | None = None) -> str:
    """The OOD score a row is shown with: ``score``, else the row's own flag score, else MSP."""
    return score or result.get("flag_score", "msp")
