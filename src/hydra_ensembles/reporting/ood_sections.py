"""The report's sections on OOD detection: near and far OOD per score, every OOD score of every
row, the flag each row ships against MSP, rows compared with the same score, and the served
flag's and prediction sets' rates on the test sets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..evaluation.evaluate import ood_score_names
from .markdown import difference, format_value, markdown_table, row_score


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
            [m, f"{flag} − {other}"] + [difference(k, d[k]) for k in ("auroc", "fpr95")]
            for m, flag, other, d in compared
        ]
        parts += [
            "## Each row's flag score against MSP (same model, same bootstrap resamples; * p < 0.05)",
            "",
            markdown_table(["Method", "Scores", "AUROC ↑", "FPR95 ↓"], body),
            "",
        ]
    parts += same_score_sections(results)
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


def sets_section(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
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


def served_section(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
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


def same_score_sections(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The paired differences between methods with the **same** OOD score, every score: does one
    method detect OOD better than another whatever score both use?"""
    parts: list[str] = []
    for m, r in results.items():
        for other, d in r.get("differences", {}).items():
            scores = [s for s in ood_score_names() if f"auroc@{s}" in d]
            if not scores:
                continue
            body = [
                [score] + [difference(k, d.get(f"{k}@{score}")) for k in ("auroc", "fpr95")]
                for score in scores
            ]
            if "auroc-vs-msp" in d:  # the row's own flag score against the other's MSP flag
                label = f"{r.get('flag_score', 'msp')} − {other}'s msp"
                body.append([label] + [difference(k, d.get(f"{k}-vs-msp")) for k in ("auroc", "fpr95")])
            parts += [
                f"## {m} − {other}, each OOD score (the same score for both; * p < 0.05)",
                "",
                markdown_table(["Score", "AUROC ↑", "FPR95 ↓"], body),
                "",
            ]
    return parts


def ood_sections(results: Mapping[str, Mapping[str, Any]], score: str | None) -> list[str]:
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
            parts += inverted_note(values)
    return parts


def inverted_note(aurocs: Mapping[str, Mapping[str, float | None]]) -> list[str]:
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
