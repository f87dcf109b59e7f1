"""Reporting: results files (JSON, CSV, Markdown in the paper's layout) and plots.

The plots load matplotlib on first use, so the tables need no plotting package."""

from typing import TYPE_CHECKING, Any

from .tables import (
    INTERVAL_COLUMNS,
    MAIN_COLUMNS,
    console_table,
    format_value,
    interval_sections,
    markdown_report,
    markdown_table,
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
    "frontier_plot",
    "head_scatter",
    "heads_map",
    "interval_sections",
    "markdown_report",
    "markdown_table",
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

_PLOTS = {
    "confidence_histograms",
    "frontier_plot",
    "head_scatter",
    "heads_map",
    "method_plots",
    "metrics_vs_pruned",
    "reliability_diagram",
    "roc_curves",
    "score_heatmap",
    "score_histograms",
    "slug",
}

if TYPE_CHECKING:
    from .plots import (
        confidence_histograms,
        frontier_plot,
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


def __getattr__(name: str) -> Any:
    if name in _PLOTS:
        from . import plots

        return getattr(plots, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
