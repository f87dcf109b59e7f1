"""Reporting: results files (JSON, CSV, Markdown in the paper's layout) and plots."""

from .plots import (
    confidence_histograms,
    head_scatter,
    heads_map,
    method_plots,
    metrics_vs_pruned,
    reliability_diagram,
    roc_curves,
    score_heatmap,
    score_histograms,
    slug,
)
from .tables import (
    INTERVAL_COLUMNS,
    MAIN_COLUMNS,
    console_table,
    format_value,
    interval_sections,
    markdown_report,
    pruning_table,
    seeds_table,
    write_results,
)

__all__ = [
    "INTERVAL_COLUMNS",
    "MAIN_COLUMNS",
    "confidence_histograms",
    "console_table",
    "format_value",
    "head_scatter",
    "heads_map",
    "interval_sections",
    "markdown_report",
    "method_plots",
    "metrics_vs_pruned",
    "pruning_table",
    "reliability_diagram",
    "roc_curves",
    "score_heatmap",
    "score_histograms",
    "seeds_table",
    "slug",
    "write_results",
]
