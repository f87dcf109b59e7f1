"""The demo end to end (`run_demo`), and over several seeds (`run_seeds`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hydra_ensembles import reporting
from hydra_ensembles.errors import InputError
from hydra_ensembles.evaluation import (
    main_row,
)
from hydra_ensembles.saving.files import atomic_write_json, atomic_write_text

from .cache import Cache
from .config import DemoConfig
from .report import cost_table, evaluate_all, pruning_curves, report_meta, write_report
from .stages import build_pruned, rank_heads, start_run, table_methods, train_baselines, unstructured_meta


def run_demo(config: DemoConfig, cache: Cache | None = None) -> dict[str, Any]:
    """Run the whole experiment; returns the results and writes the report folder. ``cache``:
    where models and rankings are kept (default: the configuration's cache folder)."""
    run = start_run(config, cache)
    baselines = train_baselines(run)
    base = baselines.singles[0]
    rankings = rank_heads(run, base)
    pruned = build_pruned(run, base, rankings)
    methods = table_methods(run, baselines, pruned)
    known = run.cache.predictions()
    preds, results, heads, temperatures = evaluate_all(run, methods, known)
    curves = run.stage.run(
        "training-free pruning curves",
        lambda: pruning_curves(base, {"Taylor": rankings.taylor, "CircAvg": rankings.circuit}, run, known),
    )
    timed = {m.cost_name: m.model for m in methods if m.cost_name}
    cost = run.stage.run("cost benchmark", lambda: cost_table(timed, run.bench.test[0], config, run.compute))
    meta = report_meta(run, base, temperatures, pruned.member_heads)
    meta.update(unstructured_meta(base, pruned))
    write_report(run, methods, results, heads, preds, meta, cost, curves, rankings, pruned)
    return {"results": results, "cost": cost, "meta": {**meta, "wall_s": run.stage.elapsed}}


def run_seeds(config: DemoConfig, seeds: list[int]) -> dict[str, Any]:
    """The demo once per seed (reports in ``out_dir/seed-<s>``), then every method's main
    metrics as mean ± std over the seeds (``out_dir/seeds.md`` and ``seeds.json``): the seeds
    vary the data sample, every model's training seed and the members' heads."""
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds needs at least two distinct seeds, got {seeds}")
    out = Path(config.out_dir)
    per_seed = {s: run_demo(replace(config, seed=s, out_dir=out / f"seed-{s}"))["results"] for s in seeds}
    summary = seed_summary(per_seed)
    atomic_write_json(out / "seeds.json", {"seeds": seeds, "summary": summary})
    text = reporting.seeds_table(summary, seeds, config.command)
    atomic_write_text(out / "seeds.md", text)
    print(text)
    return {"seeds": seeds, "summary": summary, "per_seed": per_seed}


def seed_summary(per_seed: dict[int, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """method -> metric -> [mean, std (ddof 1), n] of the main metrics over the seeds (methods
    present in every seed), the OOD metrics for each seed's own flag score (their names under
    ``flag_scores``) and for every score as ``<metric>@<score>``."""
    common = [m for m in next(iter(per_seed.values())) if all(m in r for r in per_seed.values())]
    summary = {}
    for method in common:
        rows = [main_row(r[method]) for r in per_seed.values()]
        keys = [k for k in rows[0] if all(k in r for r in rows)]
        summary[method] = {
            k: [float(np.mean([r[k] for r in rows])), float(np.std([r[k] for r in rows], ddof=1)), len(rows)]
            for k in keys
        }
        summary[method]["flag_scores"] = [r[method].get("flag_score", "msp") for r in per_seed.values()]
    return summary
