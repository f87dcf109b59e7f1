"""The demo's evaluation and report: every method's predictions and metrics, the cost table, the
training-free pruning curves, the report folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_ensembles import reporting
from hydra_ensembles.batching import model_inputs
from hydra_ensembles.cost import count_parameters, measure
from hydra_ensembles.evaluation import (
    EvalData,
    MethodPredictions,
    add_comparisons,
    add_intervals,
    add_score_comparisons,
    bootstrap_draws,
    evaluate_method,
    evaluate_predictions,
    predict_method,
)
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.members import member_overlap
from hydra_ensembles.members.ensemble import DeepEnsemble, has_dropout
from hydra_ensembles.precision import Precision, in_precision
from hydra_ensembles.runtime import describe_machine
from hydra_ensembles.saving.files import atomic_write_json
from hydra_ensembles.scoring import least_useful_first, removal_ranking
from hydra_ensembles.surgery import original_heads_per_layer, prune

from .cache import PredictionCache
from .config import DemoConfig
from .state import DemoRun, Method, PruningCurves


def evaluate_all(
    run: DemoRun, methods: list[Method], known: PredictionCache
) -> tuple[dict[str, MethodPredictions], dict[str, Any], dict[str, str], dict[str, Any]]:
    """Every method through the one evaluation path (`evaluation.run`): predictions, result rows
    (temperature-scaled rows after their method), each row's Heads label (its method's) and the
    fitted temperatures."""
    bench = run.bench
    data = EvalData(bench.test, bench.oods, bench.shifted, bench.val, bench.train, bench.ood_val)
    preds, results, heads, temperatures = {}, {}, {}, {}
    for method in methods:
        precision = method.precision or run.evaluation.name

        def predict_fn(model, batches, split, mc=method.mc_samples, precision=precision):
            return known.predict(model, batches, split, mc_samples=mc, precision=precision)

        torch.manual_seed(run.config.seed)  # MC dropout masks
        preds[method.name] = run.stage.run(
            f"predict: {method.name}",
            lambda m=method, fn=predict_fn: predict_method(m.model, data, fn, calibrate=m.calibrate),
        )
    draws, row_names = {}, {}
    for method in methods:
        rows, fitted, row_draws = run.stage.run(
            f"evaluate: {method.name}",
            lambda m=method: evaluate_method(m.name, preds[m.name], run.config.bootstrap, run.config.seed),
        )
        results.update(rows)
        draws.update(row_draws)
        row_names[method.name] = list(rows)
        heads.update(dict.fromkeys(rows, method.heads))
        temperatures.update(fitted)
    pairs = [
        (row, other + row[len(method.name) :])
        for method in methods
        for other in method.compare_with
        for row in row_names[method.name]
        if other in row_names and other + row[len(method.name) :] in results
    ]
    add_comparisons(results, draws, pairs)
    add_score_comparisons(results, draws)
    return preds, results, heads, temperatures


def report_meta(run: DemoRun, base, temperatures: dict[str, Any], member_heads) -> dict[str, str]:
    config, bench = run.config, run.bench
    layer_heads = original_heads_per_layer(base)
    evaluation = "" if run.evaluation == run.compute else f"; evaluation in {run.evaluation}"
    return {
        "command": config.command,
        "machine": describe_machine(),
        "precision": str(run.compute) + evaluation,
        "model": f"{config.model} ({type(base).__name__}, {len(layer_heads)} layers x "
        f"{layer_heads[0]} heads{', trained from scratch' if bench.from_scratch else ''})",
        **{f"data: {k}": v for k, v in run.task.describe().items()},
        "training recipe (all methods)": json.dumps(asdict(config.recipe)),
        **(
            {"Hydra members' MLP": f"{config.mlp_keep:g} of each layer's neurons, the same for every member"}
            if config.mlp_keep != 1
            else {}
        ),
        "seeds": f"run seed {config.seed}: data sample, member heads, MC masks and bootstrap; models "
        f"train with seeds {config.model_seed(0)}..{config.model_seed(config.members - 1)}",
        **({} if has_dropout(base) else {"MC Dropout": "omitted: the model has no dropout to sample"}),
        "temperatures (fit on ID val)": json.dumps(
            {
                k: round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v]
                for k, v in temperatures.items()
            }
        ),
        "member overlap (Jaccard, mean off-diagonal)": ", ".join(
            f"{k}: {_mean_offdiag(member_overlap(v, layer_heads)):.2f}" for k, v in member_heads.items()
        ),
        "scaled down": "; ".join(config.scaled_down()),
        "wall time (s)": f"{run.stage.elapsed:.0f}",
    }


def write_report(run: DemoRun, methods, results, heads, preds, meta, cost, curves, rankings, pruned) -> None:
    """report.md (+ cost section), results.json/csv, cost.json, curves, timings and plots."""
    config, out = run.config, Path(run.config.out_dir)
    atomic_write_json(out / "cost.json", cost)
    reporting.write_results(
        out,
        results,
        heads,
        meta,
        title=f"Hydra Ensembles: {config.task} benchmark (demo)",
        sections=[_cost_section(cost), reporting.pruning_table(curves.results, curves.num_pruned)],
    )
    plots = out / "plots"
    reporting.method_plots(
        plots, preds, [m.name for m in methods if m.reliability], [m.name for m in methods if m.detail]
    )
    for kind, sets in pruned.member_heads.items():
        reporting.heads_map(sets, rankings.circuit.original_heads_per_layer, plots / f"heads_{kind}.png")
    reporting.score_heatmap(
        rankings.taylor.numpy(), plots / "taylor_scores.png", "Taylor importance", "score"
    )
    reporting.score_heatmap(
        removal_ranking(rankings.circuit),
        plots / "circuit_order.png",
        "CircAvg removal step (blank = kept)",
        "step",
    )
    reporting.metrics_vs_pruned(curves.curves, plots / "metrics_vs_pruned.png")
    atomic_write_json(out / "pruning_curves.json", curves.curves)
    atomic_write_json(
        out / "pruning_table.json", {"num_pruned": curves.num_pruned, "results": curves.results}
    )
    atomic_write_json(out / "timings.json", run.stage.timings)
    print()
    print(reporting.console_table(results, heads))
    print(
        f"\ncost ({cost['precision']}, batch of {cost['input']}): "
        + ", ".join(
            f"{k} {v['median_ms']:.0f} ms / {v['params'] / 1e6:.1f}M params / {v['gmacs']:.1f} GMAC"
            for k, v in cost["methods"].items()
        )
    )
    print(f"report: {out / 'report.md'} (+ results.json, results.csv, cost.json, plots/)")
    print(f"done in {run.stage.elapsed:.0f} s")


def _mean_offdiag(matrix: np.ndarray) -> float:
    m = matrix.shape[0]
    return float((matrix.sum() - np.trace(matrix)) / (m * m - m)) if m > 1 else 1.0


def cost_table(
    models: dict[str, Any], batch: dict[str, torch.Tensor], config: DemoConfig, compute: Precision
) -> dict[str, Any]:
    """Latency (interleaved, in ``compute``: what the user runs), parameters and multiply-adds of
    ``models`` (name -> model or explicit ensemble), timed as copies in ``compute``'s dtype."""
    inputs = model_inputs(batch)
    members = {k: list(m.members) if isinstance(m, DeepEnsemble) else [m] for k, m in models.items()}
    members = {k: [in_precision(x, compute) for x in ms] for k, ms in members.items()}
    runs = {k: partial(_run_all, ms, inputs) for k, ms in members.items()}
    measured = measure(runs, repeats=config.bench_repeats, warmup=1)
    params = {k: sum(count_parameters(x) for x in ms) for k, ms in members.items()}
    return {
        "batch": int(batch["labels"].shape[0]),
        "input": _describe_input(inputs),
        "precision": compute.name,
        "precision_reason": compute.reason,
        "methods": {k: {**measured[k], "params": params[k]} for k in runs},
    }


def pruning_curves(base, rankings: dict[str, Any], run: DemoRun, known: PredictionCache) -> PruningCurves:
    """Prune the first n heads of each ranking (no training), measure accuracy, ECE, AUROC and
    FPR95 (MSP, near/far average) on the test sets; n = the heads each member prunes is a step."""
    config, test, oods = run.config, run.bench.test, run.bench.oods
    pruned = config.num_pruned
    steps = sorted(
        {0, pruned, *range(config.curve_step, config.pool_size + 1, config.curve_step), config.pool_size}
    )
    curves: dict[str, dict[str, list]] = {m: {} for m in ("accuracy", "ECE", "AUROC", "FPR95")}
    results: dict[str, Any] = {}
    draws: dict[str, Any] = {}
    for method, ranking in rankings.items():
        order, counts = least_useful_first(ranking)
        for n in steps:
            model = prune(base, HeadSet.without(order[:n], counts)) if n else base  # n = 0: already predicted
            run_on = partial(known.predict, model, progress=False, precision=run.evaluation.name)
            p_test = run_on(test, "test")
            p_ood = {name: (kind, run_on(b, name)) for name, (kind, b) in oods.items()}
            result = evaluate_predictions(p_test, p_ood, scores=("msp",))
            summary = result["ood_summary"]["msp"]
            for metric, value in (
                ("accuracy", result["classification"]["acc"]),
                ("ECE", result["classification"]["ece"]),
                ("AUROC", summary["average"]["auroc"]),
                ("FPR95", summary["average"]["fpr95"]),
            ):
                curves[metric].setdefault(method, []).append((n, value))
            name = "Single" if n == 0 else method
            if n in (0, pruned) and name not in results:
                results[name] = result
                if config.bootstrap:
                    draws[name] = bootstrap_draws(p_test, p_ood, 1.0, config.bootstrap, config.seed)
    add_intervals(results, draws)
    add_comparisons(results, draws, [(method, "Single") for method in rankings])
    return PruningCurves(curves, pruned, results)


def _describe_input(inputs: dict[str, torch.Tensor]) -> str:
    """``"64 x 32 tokens"`` or ``"64 images of 1x28x28"``."""
    if "input_ids" in inputs:
        batch, tokens = inputs["input_ids"].shape
        return f"{batch} x {tokens} tokens"
    pixels = inputs["pixel_values"]
    return f"{pixels.shape[0]} images of {'x'.join(str(d) for d in pixels.shape[1:])}"


def _run_all(models, inputs):
    """One forward pass of every model (an explicit ensemble runs its members one by one)."""
    return [m(**inputs) for m in models]


def _cost_section(cost: dict[str, Any]) -> str:
    """The report's cost section (Markdown)."""
    single = cost["methods"]["Single"]
    rows = [
        [
            name,
            f"{row['median_ms']:.0f}",
            f"{row['median_ms'] / single['median_ms']:.2f}",
            f"{row['params'] / 1e6:.1f}",
            f"{row['gmacs']:.1f}",
        ]
        for name, row in cost["methods"].items()
    ]
    title = (
        f"## Cost ({cost['precision']}: {cost['precision_reason']}; batch of {cost['input']}, median latency)"
    )
    table = reporting.markdown_table(["Method", "Latency (ms)", "x Single", "Params (M)", "GMAC"], rows)
    return f"\n{title}\n\n{table}\n"
