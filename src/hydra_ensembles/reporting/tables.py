"""Results as files: JSON, CSV and a Markdown report in the paper's table layout."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.evaluate import main_row
from ..metrics import POSITIVE_CLASS
from ..saving.files import atomic_write_json, atomic_write_text
from .markdown import bold_best, difference, format_value, markdown_table, row_score
from .ood_sections import ood_sections, score_sections, served_section, sets_section

# (key, header, higher is better)
MAIN_COLUMNS = [
    ("acc", "Acc ↑", True),
    ("brier", "Brier ↓", False),
    ("nll", "NLL ↓", False),
    ("ece", "ECE ↓", False),
    ("aece", "aECE ↓", False),
    ("auroc", "AUROC ↑", True),
    ("fpr95", "FPR95 ↓", False),
    ("aupr_in", "AUPR-In ↑", True),
    ("aupr_out", "AUPR-Out ↑", True),
]


INTERVAL_COLUMNS = ("acc", "nll", "ece", "auroc", "fpr95")
"""The columns whose intervals and paired differences the report shows (all are in results.json)."""


def interval_sections(results: Mapping[str, Mapping[str, Any]], heading: str = "##") -> list[str]:
    """Bootstrap intervals of every row that has them, and paired differences between rows
    (sections under Markdown ``heading`` level)."""
    parts: list[str] = []
    with_ci = [(m, r) for m, r in results.items() if "intervals" in r]
    if with_ci:
        meta = with_ci[0][1].get("intervals_meta", {})
        keys = [k for k in INTERVAL_COLUMNS if k in with_ci[0][1]["intervals"]]
        headers = [h for k, h, _ in MAIN_COLUMNS if k in keys]
        body = [
            [m]
            + [
                f"{format_value(k, r['intervals'][k][0])} – {format_value(k, r['intervals'][k][1])}"
                for k in keys
            ]
            for m, r in with_ci
        ]
        parts += [
            f"{heading} {100 * meta.get('level', 0.95):.0f}% bootstrap intervals "
            f"({meta.get('resamples', '?')} resamples of the test items)",
            "",
            markdown_table(["Method", *headers], body),
            "",
        ]
    compared = [(m, other, d) for m, r in results.items() for other, d in r.get("differences", {}).items()]
    if compared:
        keys = [k for k in INTERVAL_COLUMNS if k in compared[0][2]]
        headers = [h for k, h, _ in MAIN_COLUMNS if k in keys]
        body = [[f"{m} − {other}"] + [difference(k, d[k]) for k in keys] for m, other, d in compared]
        parts += [
            f"{heading} Paired differences (same bootstrap resamples; * p < 0.05, two-sided)",
            "",
            markdown_table(["Comparison", *headers], body),
            "",
        ]
    return parts


def seeds_table(
    summary: Mapping[str, Mapping[str, Sequence[float]]], seeds: Sequence[int], command: str
) -> str:
    """Main metrics as mean ± std over seeds (`hydra_experiments.seed_summary`), the OOD columns
    for each seed's flag score (named per seed), then every score's OOD average AUROC and FPR95."""
    headers = ["Method", "OOD score"] + [h for _, h, _ in MAIN_COLUMNS]

    def cell(v: Mapping[str, Any], k: str) -> str:
        metric = k.partition("@")[0]
        return f"{format_value(metric, v[k][0])} ± {format_value(metric, v[k][1])}" if k in v else "–"

    body = [
        [method, ", ".join(v.get("flag_scores", ["msp"]))] + [cell(v, k) for k, _, _ in MAIN_COLUMNS]
        for method, v in summary.items()
    ]
    scores = list(dict.fromkeys(k.partition("@")[2] for v in summary.values() for k in v if "@" in k))
    by_score = []
    for key, label in (("auroc", "AUROC ↑"), ("fpr95", "FPR95 ↓")):
        rows = [[method] + [cell(v, f"{key}@{s}") for s in scores] for method, v in summary.items()]
        by_score += [f"## OOD average {label} by score", "", markdown_table(["Method", *scores], rows), ""]
    return "\n".join(
        [
            f"# Mean ± std over seeds {', '.join(map(str, seeds))}",
            "",
            f"`{command} --seeds {','.join(map(str, seeds))}`; each seed's report (with bootstrap "
            "intervals and paired differences) is in `seed-<s>/`. OOD columns: each seed's flag score "
            "(chosen on ID and OOD validation data; listed per seed).",
            "",
            markdown_table(headers, body),
            "",
            *(by_score if scores else []),
        ]
    )


def markdown_report(
    results: Mapping[str, Mapping[str, Any]],
    heads: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
    score: str | None = None,
    title: str = "Hydra Ensembles evaluation",
) -> str:
    """The report: main table, intervals, near/far OOD, OOD scores, diversity and shift sections
    (each present when some result has the data). ``score``: the OOD score of every row (None:
    each row's own ``flag_score``)."""
    parts = [f"# {title}", ""]
    if meta:
        parts += [f"- **{k}**: {v}" for k, v in meta.items()] + [""]
    parts += _main_section(results, heads or {}, score)
    parts += interval_sections(results)
    parts += ood_sections(results, score)
    parts += score_sections(results)
    parts += served_section(results)
    parts += sets_section(results)
    parts += _diversity_section(results)
    parts += _shift_sections(results)
    return "\n".join(parts)


def _main_section(
    results: Mapping[str, Mapping[str, Any]], heads: Mapping[str, str], score: str | None
) -> list[str]:
    rows = {m: main_row(r, score) for m, r in results.items()}
    shown = bold_best(rows, MAIN_COLUMNS)
    which = (
        f"score = {score.upper()}"
        if score
        else "each row's flag score (the **OOD score** column: the one the library would ship for it, "
        "chosen on ID validation and OOD validation data, never on these test sets)"
    )
    return [
        f"Percentages except Brier and NLL. OOD columns: average of the near-OOD and far-OOD means, "
        f"{which}, **{POSITIVE_CLASS} is the positive class**; FPR95 is the share of ID "
        "samples flagged at the threshold that catches 95% of OOD samples. Best value in bold.",
        "",
        markdown_table(
            ["Method", "Heads", "OOD score"] + [h for _, h, _ in MAIN_COLUMNS],
            [
                [m, heads.get(m, ""), row_score(results[m], score)]
                + [shown[m][k] for k, _, _ in MAIN_COLUMNS]
                for m in results
            ],
        ),
        "",
    ]


def _diversity_section(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    diversity = [(m, r["diversity"]) for m, r in results.items() if "diversity" in r]
    if not diversity:
        return []
    sets = list(diversity[0][1])
    body = [
        [m] + [f"{d[s]['mutual_information']:.4f} / {100 * d[s]['disagreement']:.2f}" for s in sets]
        for m, d in diversity
    ]
    return [
        "## Diversity (mutual information, nats / disagreement, %)",
        "",
        markdown_table(["Method", *sets], body),
        "",
    ]


def _shift_sections(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Accuracy and Brier per corruption severity (mean over corruptions) and their average."""
    shifted = [(m, r["shift"]) for m, r in results.items() if "shift" in r]
    if not shifted:
        return []
    severities = sorted({v["severity"] for v in shifted[0][1].values()})
    headers = ["Method"] + [f"sev {s}" for s in severities] + ["Average"]
    parts: list[str] = []
    for key, label in (("acc", "Accuracy"), ("brier", "Brier")):
        body = []
        for method, shift in shifted:
            means = [
                float(np.mean([v[key] for v in shift.values() if v["severity"] == s])) for s in severities
            ]
            body.append(
                [method] + [format_value(key, x) for x in means] + [format_value(key, float(np.mean(means)))]
            )
        parts += [f"## {label} under shift (mean over corruptions)", "", markdown_table(headers, body), ""]
    return parts


def write_results(
    out_dir: str | os.PathLike,
    results: Mapping[str, Mapping[str, Any]],
    heads: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
    score: str | None = None,
    title: str = "Hydra Ensembles evaluation",
    sections: Sequence[str] = (),
) -> dict[str, Path]:
    """Write ``results.json``, ``results.csv`` and ``report.md`` (atomically) to ``out_dir``;
    ``sections`` (Markdown) follow the report's own, in order."""
    out = Path(out_dir)
    files = {"json": out / "results.json", "csv": out / "results.csv", "markdown": out / "report.md"}
    atomic_write_json(
        files["json"], {"meta": dict(meta or {}), "heads": dict(heads or {}), "results": results}
    )
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["method", "heads", "ood_score"] + [k for k, _, _ in MAIN_COLUMNS])
    for method, result in results.items():
        row = main_row(result, score)
        writer.writerow(
            [method, (heads or {}).get(method, ""), row_score(result, score)]
            + [row.get(k, "") for k, _, _ in MAIN_COLUMNS]
        )
    atomic_write_text(files["csv"], buffer.getvalue())
    atomic_write_text(
        files["markdown"], markdown_report(results, heads, meta, score, title) + "".join(sections)
    )
    return files


CONSOLE_COLUMNS = [
    ("acc", "Acc"),
    ("brier", "Brier"),
    ("nll", "NLL"),
    ("ece", "ECE"),
    ("aece", "aECE"),
    ("auroc", "AUROC"),
    ("fpr95", "FPR95"),
    ("aupr_in", "AUPR-In"),
]


def console_table(results: Mapping[str, Any], heads: Mapping[str, str]) -> str:
    """The main table as fixed-width text for a terminal (percentages, Brier and NLL as is)."""
    lines = [f"{'Method':30s} {'Heads':>7s} " + " ".join(f"{h:>7s}" for _, h in CONSOLE_COLUMNS)]
    for name, result in results.items():
        row = main_row(result)
        cells = [
            f"{100 * row[k]:7.2f}" if k not in ("brier", "nll") else f"{row[k]:7.3f}"
            for k, _ in CONSOLE_COLUMNS
        ]
        lines.append(f"{name:30s} {heads[name]:>7s} " + " ".join(cells))
    return "\n".join(lines)


def pruning_table(results: Mapping[str, Mapping[str, Any]], num_pruned: int, score: str = "msp") -> str:
    """The paper's Table 4 layout for training-free pruning (`hydra_experiments.PruningCurves`): accuracy,
    ECE and near-/far-OOD means of AUROC, FPR95 and AUPR-Out, then the rows' bootstrap intervals
    and paired differences, as a report section."""
    columns = [("auroc", "AUROC ↑"), ("fpr95", "FPR95 ↓"), ("aupr_out", "AUPR-Out ↑")]
    headers = ["Method", "Acc ↑", "ECE ↓"] + [f"{kind} {h}" for kind in ("Near", "Far") for _, h in columns]
    body = []
    for method, result in results.items():
        summary, classification = result["ood_summary"][score], result["classification"]
        body.append(
            [method, format_value("acc", classification["acc"]), format_value("ece", classification["ece"])]
            + [format_value(k, summary.get(kind, {}).get(k)) for kind in ("near", "far") for k, _ in columns]
        )
    return "\n".join(
        [
            "",
            f"## Training-free pruning: {num_pruned} heads (paper Table 4 layout)",
            "",
            "The base model with the heads each ranking scores least useful removed, no fine-tuning "
            f"(Single: nothing removed); {score.upper()} score, OOD positive. The full curves are in "
            "`plots/metrics_vs_pruned.png` and `pruning_curves.json`.",
            "",
            markdown_table(headers, body),
            "",
            *interval_sections(results, heading="###"),
        ]
    )
