"""Reporting: results files (JSON, CSV, Markdown in the paper's layout) and plots."""

from .plots import (
    confidence_histograms,
    heads_map,
    method_plots,
    metrics_vs_pruned,
    reliability_diagram,
    roc_curves,
    score_heatmap,
    score_histograms,
    slug,
)
from .tables import console_table, main_row, markdown_report, write_results

__all__ = [
    "confidence_histograms",
    "console_table",
    "heads_map",
    "main_row",
    "markdown_report",
    "method_plots",
    "metrics_vs_pruned",
    "reliability_diagram",
    "roc_curves",
    "score_heatmap",
    "score_histograms",
    "slug",
    "write_results",
]
