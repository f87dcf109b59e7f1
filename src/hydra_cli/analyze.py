"""``hydra-ens analyze``: the paper's analysis on the demo's models."""

from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command
from .options import COUNT, _resamples, precision_option


def _cmd_analyze(args: argparse.Namespace) -> int:
    from hydra_ensembles.runtime import ensure_cpu_allocator_tuned
    from hydra_experiments.analyze import analysis_config, run_analysis

    from .guards import output_lock

    ensure_cpu_allocator_tuned()
    config = analysis_config(
        args.task,
        studies=tuple(s.strip() for s in args.studies.split(",") if s.strip()),
        out_dir=Path(args.out or ("runs/analysis" if args.task == "text" else f"runs/analysis-{args.task}")),
        items=args.items,
        probes=args.probes,
        max_members=args.max_members,
        bootstrap=args.bootstrap,
        cache_dir=Path(args.cache_dir),
        precision=args.precision,
    )
    with output_lock(config.out_dir):
        run_analysis(config)
    return 0


def _add_analyze_arguments(analyze: argparse.ArgumentParser) -> None:
    from hydra_ensembles.analysis import STUDIES

    analyze.add_argument("--task", choices=["text", "image"], default="text")
    analyze.add_argument(
        "--studies",
        default=",".join(STUDIES),
        help=f"comma-separated, from {', '.join(STUDIES)} (default: all)",
    )
    analyze.add_argument("--out", help="report folder (default runs/analysis, image: runs/analysis-image)")
    analyze.add_argument("--cache-dir", default="runs/cache", help="the demo's cache (models are reused)")
    analyze.add_argument("--items", type=COUNT, default=64, help="ID validation items for Proposition 1")
    analyze.add_argument("--probes", type=COUNT, default=8, help="Hutchinson probes (at least 2)")
    analyze.add_argument("--max-members", type=COUNT, default=5, help="member-count study: M = 2 .. this")
    analyze.add_argument(
        "--bootstrap", type=_resamples, default=200, help="bootstrap resamples for intervals"
    )
    precision_option(analyze)


COMMAND = Command(
    "analyze",
    help="the paper's analysis on the demo's models: Proposition 1's conditions, what heads "
    "represent, member count, merged vs exact MLPs (reuses the demo's cached models)",
    add_arguments=_add_analyze_arguments,
    run=_cmd_analyze,
    locks_outputs=False,
    reports_precision=True,
)
