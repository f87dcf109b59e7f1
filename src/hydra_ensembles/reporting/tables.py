"""Results as files: JSON, CSV and a Markdown report in the paper's table layout."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..evaluation.evaluate import main_row, ood_score_names
from ..metrics import POSITIVE_CLASS
from ..saving.files import atomic_write_json, atomic_write_text

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
PERCENT = {"acc", "ece", "aece", "aurc", "auroc", "fpr95", "aupr_in", "aupr_out"}


def format_value(key: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.2f}" if key in PERCENT else f"{value:.3f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: one header row, a separator, one line per row (cells as given)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _bold_best(values: dict[str, dict[str, float]], columns) -> dict[str, dict[str, str]]:
    out = {m: {} for m in values}
    for key, _, higher in columns:
        present = [v[key] for v in values.values() if key in v]
        best = (max if higher else min)(present) if present else None
        for method, v in values.items():
            text = format_value(key, v.get(key))
            out[method][key] = f"**{text}**" if key in v and v[key] == best and len(present) > 1 else text
    return out


INTERVAL_COLUMNS = ("acc", "nll", "ece", "auroc", "fpr95")
"""The columns whose intervals and paired differences the report shows (all are in results.json)."""


def _signed(key: str, value: float) -> str:
    return f"{100 * value:+.2f}" if key in PERCENT else f"{value:+.3f}"


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
        body = [[f"{m} − {other}"] + [_difference(k, d[k]) for k in keys] for m, other, d in compared]
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
    parts += _ood_sections(results, score)
    parts += score_sections(results)
    parts += _served_section(results)
    parts += _sets_section(results)
    parts += _diversity_section(results)
    parts += _shift_sections(results)
    return "\n".join(parts)


def row_score(result: Mapping[str, Any], score: str | None = None) -> str:
    """The OOD score a row is shown with: ``score``, else the row's own flag score, else MSP."""
    return score or result.get("flag_score", "msp")


def _main_section(
    results: Mapping[str, Mapping[str, Any]], heads: Mapping[str, str], score: str | None
) -> list[str]:
    rows = {m: main_row(r, score) for m, r in results.items()}
    shown = _bold_best(rows, MAIN_COLUMNS)
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


def score_sections(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each row's flag score against every other score of the same row (paired differences of the
    OOD average), and the members' spread of each feature score's AUROC."""
    compared = [
        (m, r["flag_score"], other, d)
        for m, r in results.items()
        for other, d in r.get("score_differences", {}).items()
        if other == "msp"
    ]
    parts: list[str] = []
    if compared:
        body = [
            [m, f"{flag} − {other}"] + [_difference(k, d[k]) for k in ("auroc", "fpr95")]
            for m, flag, other, d in compared
        ]
        parts += [
            "## Each row's flag score against MSP (same model, same bootstrap resamples; * p < 0.05)",
            "",
            markdown_table(["Method", "Scores", "AUROC ↑", "FPR95 ↓"], body),
            "",
        ]
    parts += _same_score_sections(results)
    spread, seen = [], []
    for m, r in results.items():
        member_auroc = [s.get("member_auroc", {}) for s in r.get("ood", {}).values()]
        if not member_auroc or not member_auroc[0] or member_auroc in seen:
            continue  # a temperature-scaled row has its method's features: shown once
        seen.append(member_auroc)
        for score in member_auroc[0]:
            per_member = zip(*[a[score] for a in member_auroc], strict=True)
            spread.append((m, score, [100 * float(np.mean(v)) for v in per_member]))
    if spread:
        width = max(len(values) for _, _, values in spread)
        body = [
            [m, score, *[f"{v:.2f}" for v in values], *["–"] * (width - len(values))]
            for m, score, values in spread
        ]
        parts += [
            "## Feature scores member by member (AUROC, mean over the OOD sets)",
            "",
            markdown_table(["Method", "Score", *[f"member {i}" for i in range(width)]], body),
            "",
        ]
    return parts


def _sets_section(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Conformal prediction sets on the ID test (fit on the validation data): coverage and mean
    size per method and level, the selective risk (AURC), and the ID test share the row's
    conformal flag raises."""
    rows = [(m, r) for m, r in results.items() if "conformal_sets" in r]
    if not rows:
        return []
    levels = list(rows[0][1]["conformal_sets"])
    flag_level = next((r["flag_rate"]["alpha"] for _, r in rows if "flag_rate" in r), None)
    headers = ["Method", "AURC ↓", f"ID flagged, α={flag_level}"] + [
        f"{kind} α={level} {what}" for level in levels for kind in ("LAC", "APS") for what in ("cov.", "size")
    ]
    body = [
        [
            m,
            format_value("aurc", r["classification"].get("aurc")),
            f"{100 * r['flag_rate']['id_test_rate']:.1f} ({r['flag_score']})" if "flag_rate" in r else "–",
        ]
        + [
            f"{100 * r['conformal_sets'][level][kind][key]:.1f}"
            if key == "coverage"
            else f"{r['conformal_sets'][level][kind][key]:.2f}"
            for level in levels
            for kind in ("lac", "aps")
            for key in ("coverage", "mean_size")
        ]
        for m, r in rows
    ]
    return [
        "## Conformal prediction sets, the flag's false alarms and selective risk (ID test)",
        "",
        "Split conformal sets fit on the ID validation data (plain rows at temperature 1; + TS rows "
        "at a temperature fit on the even-numbered validation inputs, the sets on the odd-numbered "
        "ones), coverage (target at least 1 - α) and mean size on the ID test. ID flagged: the "
        "share of ID test inputs the row's conformal flag (its flag score, threshold fit on the ID "
        "validation data) raises, at most α in expectation. AURC: the area under the risk-coverage "
        "curve of answering the most confident inputs first (%).",
        "",
        markdown_table(headers, body),
        "",
    ]


def _served_section(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The share of each set the saved calibration's flag raises, and its prediction sets'
    coverage and size on the ID test, for rows measured as saved."""
    served = [(m, r) for m, r in results.items() if "flagged" in r]
    if not served:
        return []
    sets = list(served[0][1]["flagged"])
    body = []
    for m, r in served:
        row = [m, r["flag_score"], *[f"{100 * r['flagged'].get(s, float('nan')):.1f}" for s in sets]]
        if "sets" in r:
            coverage, floor = 100 * r["sets"]["coverage"], 100 * (1 - r["sets"]["alpha"])
            draw = r["sets"].get("one_draw_floor")  # 95% of calibration draws cover at least this
            margin = f"; one draw >= {100 * draw:.1f}" if draw is not None else ""
            row += [f"{coverage:.1f} (target >= {floor:.0f}{margin})", f"{r['sets']['mean_size']:.2f}"]
        else:
            row += ["–", "–"]
        body.append(row)
    return [
        "## As served: the share each saved flag raises (%), and the prediction sets",
        "",
        "The saved calibration (temperature, flag score, statistics, threshold and prediction sets) "
        "as `predict` and the pipelines apply it. A conformal flag raises at most 1 - keep of ID "
        "inputs in expectation; the sets hold the true ID class at least 1 - alpha of the time.",
        "",
        markdown_table(["Method", "Flag score", *sets, "Set coverage, ID test", "Mean set size"], body),
        "",
    ]


def _same_score_sections(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The paired differences between methods with the **same** OOD score, every score: does one
    method detect OOD better than another whatever score both use?"""
    parts: list[str] = []
    for m, r in results.items():
        for other, d in r.get("differences", {}).items():
            scores = [s for s in ood_score_names() if f"auroc@{s}" in d]
            if not scores:
                continue
            body = [
                [score] + [_difference(k, d.get(f"{k}@{score}")) for k in ("auroc", "fpr95")]
                for score in scores
            ]
            if "auroc-vs-msp" in d:  # the row's own flag score against the other's MSP flag
                label = f"{r.get('flag_score', 'msp')} − {other}'s msp"
                body.append([label] + [_difference(k, d.get(f"{k}-vs-msp")) for k in ("auroc", "fpr95")])
            parts += [
                f"## {m} − {other}, each OOD score (the same score for both; * p < 0.05)",
                "",
                markdown_table(["Score", "AUROC ↑", "FPR95 ↓"], body),
                "",
            ]
    return parts


def _difference(key: str, d: Mapping[str, float] | None) -> str:
    """A paired difference as ``+1.23 [+0.10, +2.30] p=0.03 *``."""
    if d is None:
        return "–"
    star = " *" if d["p_value"] < 0.05 else ""
    interval = f"[{_signed(key, d['low'])}, {_signed(key, d['high'])}]"
    return f"{_signed(key, d['difference'])} {interval} p={d['p_value']:.2f}{star}"


def _ood_sections(results: Mapping[str, Mapping[str, Any]], score: str | None) -> list[str]:
    """Near/far means and per-set AUROC for each row's score; average AUROC and FPR95 for every
    score."""
    breakdown = [(m, r) for m, r in results.items() if "ood" in r]
    if not breakdown:
        return []
    first = breakdown[0][1]["ood"]
    sets = list(first)
    headers = ["Method", "Near AUROC", "Near FPR95", "Far AUROC", "Far FPR95"] + [
        f"{s} ({first[s]['kind']}) AUROC" for s in sets
    ]
    body = []
    for method, r in breakdown:
        own = row_score(r, score)
        summary = r["ood_summary"][own]
        body.append(
            [method]
            + [
                format_value(k, summary.get(kind, {}).get(k))
                for kind in ("near", "far")
                for k in ("auroc", "fpr95")
            ]
            + [format_value("auroc", r["ood"][s]["scores"][own]["auroc"]) for s in sets]
        )
    score_names = list(dict.fromkeys(s for _, r in breakdown for s in r["ood_summary"]))
    parts = ["## Near- and far-OOD", "", markdown_table(headers, body), ""]
    for key, label in (("auroc", "AUROC ↑"), ("fpr95", "FPR95 ↓")):
        values = {m: {s: _average(r, s, key) for s in score_names} for m, r in breakdown}
        best = {
            s: (max if key == "auroc" else min)(present)
            for s in score_names
            if (present := [v[s] for v in values.values() if v[s] is not None])
        }
        body = [[m] + [_marked(key, v[s], best.get(s)) for s in score_names] for m, v in values.items()]
        title = f"## OOD average {label} by score (best per score in bold)"
        parts += [title, "", markdown_table(["Method", *score_names], body), ""]
        if key == "auroc":
            parts += _inverted_note(values)
    return parts


def _inverted_note(aurocs: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    """A sentence naming the scores whose AUROC is below 50% for some method: they rank the OOD
    sets as more in-distribution than the ID test (the score points the wrong way on this data)."""
    inverted = sorted({s for v in aurocs.values() for s, a in v.items() if a is not None and a < 0.5})
    if not inverted:
        return []
    return [
        f"Inverted here: {', '.join(inverted)} (AUROC below 50% for some method): on this data the "
        "score ranks the OOD inputs as *more* in-distribution than the ID test, so it flags the "
        "wrong inputs; the flag score is never chosen by its reversal.",
        "",
    ]


def _marked(key: str, value: float | None, best: float | None) -> str:
    text = format_value(key, value)
    return f"**{text}**" if value is not None and value == best else text


def _average(result: Mapping[str, Any], score: str, key: str) -> float | None:
    return result["ood_summary"].get(score, {}).get("average", {}).get(key)


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
