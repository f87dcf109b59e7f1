"""Reporting: results files (JSON, CSV, Markdown in the paper's layout) and plots."""

from .plots import (
    confidence_histograms,
    heads_map,
    metrics_vs_pruned,
    reliability_diagram,
    roc_curves,
    score_heatmap,
    score_histograms,
)
from .tables import main_row, markdown_report, write_results

__all__ = [
    "confidence_histograms",
    "heads_map",
    "main_row",
    "markdown_report",
    "metrics_vs_pruned",
    "reliability_diagram",
    "roc_curves",
    "score_heatmap",
    "score_histograms",
    "write_results",
]
