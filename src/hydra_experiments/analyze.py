"""``hydra-ens analyze``: the paper's analysis (appendices A.2, B.1, B.2, B.6, B.7) on a demo task.

Every study starts from the demo's own models (the fine-tuned Single model, its Taylor and
CircAvg rankings, the Hydra (Circ) members), taken from the demo's cache or trained once:

* ``prop1`` (B.1): Proposition 1's conditions for the Taylor, CircAvg and a random head set
  pruning the same number of heads, with clean data = ID validation items and noisy data = the
  same items corrupted (`analysis.curvature`);
* ``heads`` (B.2): each last-layer head's [CLS] vector, ID test vs every OOD test set: centroid
  distances for the heads the circuit keeps vs removes, in the dense and in the pruned model, and
  a PCA of the most and least important heads (`analysis.representations`);
* ``members`` (B.6): Hydra (Circ) and the Deep Ensemble with M = 2 .. ``max_members`` members
  (members are nested: member m is the same model for every M): quality and cost curves;
* ``merge`` (B.7): the same Hydra (Circ) members fused with merged MLPs (the paper) and exactly,
  and run one by one: every metric, diversity, and the paired differences.

Nothing here selects anything: the head sets come from the demo's rankings, which use ID
validation data and the OOD validation set only.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_ensembles import reporting
from hydra_ensembles.analysis import STUDIES, proposition1
from hydra_ensembles.analysis.representations import centroid_distances, head_vectors, pca_2d
from hydra_ensembles.errors import InputError
from hydra_ensembles.evaluation import (
    EvalData,
    add_comparisons,
    corrupt_images,
    corrupt_texts,
    evaluate_method,
    main_row,
    predict_method,
)
from hydra_ensembles.fusion import fuse
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.members import DeepEnsemble
from hydra_ensembles.runtime import describe_machine
from hydra_ensembles.saving.files import atomic_write_json, atomic_write_text
from hydra_ensembles.scoring import least_useful_first, removal_ranking
from hydra_ensembles.surgery import original_heads_per_layer, prune

from .cache import Cache, PredictionCache
from .config import DemoConfig
from .report import cost_table
from .stages import pruned_member, rank_heads, start_run, trained_single
from .state import DemoRun, Rankings
from .tasks import Dataset

CORRUPTION = {"text": "char_typos", "image": "gaussian_noise"}
"""The noise of Proposition 1's noisy data, per task (severity `AnalysisConfig.severity`)."""


@dataclass
class AnalysisConfig:
    """What ``hydra-ens analyze`` runs; the demo's own configuration supplies the models."""

    task: str = "text"
    studies: tuple[str, ...] = STUDIES
    out_dir: Path = Path("runs/analysis")
    items: int = 64
    """ID validation items for Proposition 1 (clean, and the same items corrupted)."""
    severity: int = 3
    probes: int = 8
    """Hutchinson probes (each: two Hessian-vector products on clean and two on noisy data)."""
    max_members: int = 5
    bootstrap: int = 200
    seed: int = 0
    demo: DemoConfig = field(default_factory=DemoConfig)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.studies) - set(STUDIES))
        if unknown or not self.studies:
            raise InputError(f"unknown studies {unknown}; choose from {', '.join(STUDIES)}")
        if self.max_members < 2:
            raise InputError(f"max_members must be at least 2, got {self.max_members}")
        if self.items < 2:
            raise InputError(f"items must be at least 2, got {self.items}")


def run_analysis(config: AnalysisConfig, cache: Cache | None = None) -> dict[str, Any]:
    """Run the chosen studies; writes analysis.json, report.md and plots/ under ``out_dir``.
    ``cache``: the demo's models and rankings (default: the configuration's cache folder)."""
    run = start_run(config.demo, cache)
    base = trained_single(run, 0)
    rankings = rank_heads(run, base)
    out = Path(config.out_dir)
    results: dict[str, Any] = {
        "meta": {
            "command": "hydra-ens analyze" + (f" --task {config.task}" if config.task != "text" else ""),
            "machine": describe_machine(),
            "precision": str(run.compute),
            "model": config.demo.model,
            "config": {
                k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "demo"
            },
        }
    }
    studies = {"prop1": _prop1, "heads": _heads, "members": _members, "merge": _merge}
    for name in config.studies:
        results[name] = run.stage.run(
            f"study: {name}", lambda f=studies[name]: f(run, config, base, rankings, out)
        )
    results["meta"]["wall_s"] = round(run.stage.elapsed, 1)
    atomic_write_json(out / "analysis.json", results)
    atomic_write_text(out / "report.md", analysis_report(results))
    print(analysis_report(results))
    print(f"report: {out / 'report.md'} (+ analysis.json, plots/); done in {run.stage.elapsed:.0f} s")
    return results


# --------------------------------------------------------------------------- studies
def _pruned_head_sets(run: DemoRun, base, rankings: Rankings) -> dict[str, HeadSet]:
    """CircAvg's single pruned head set, Taylor's pruning as many heads (the demo's per-layer
    Taylor set where it does; else the lowest global Taylor scores), and a seeded random one."""
    counts = original_heads_per_layer(base)
    circ = rankings.circuit.head_set(run.config.num_pruned)
    removed = sum(counts) - circ.num_kept(counts)
    taylor = rankings.taylor_single
    if sum(counts) - taylor.num_kept(counts) != removed:
        taylor = HeadSet.without(least_useful_first(rankings.taylor)[0][:removed], counts)
    everything = [(layer, h) for layer, n in enumerate(counts) for h in range(n)]
    chosen = random.Random(f"analysis-random:{run.config.seed}").sample(everything, removed)
    return {"Taylor": taylor, "CircAvg": circ, "Random": HeadSet.without(chosen, counts)}


def _noisy(data: Dataset, task: str, severity: int, seed: int) -> Dataset:
    if task == "image":
        return corrupt_images(data, CORRUPTION[task], severity, seed)
    return corrupt_texts(data, CORRUPTION[task], severity, seed)


def _prop1(run: DemoRun, config: AnalysisConfig, base, rankings: Rankings, out: Path) -> dict[str, Any]:
    clean_data = run.task.val.subset(range(min(config.items, len(run.task.val))))
    noisy_data = _noisy(clean_data, config.task, config.severity, config.seed)
    length = run.config.max_length
    clean = run.bench.batches(clean_data, length, batch_size=32)
    noisy = run.bench.batches(noisy_data, length, batch_size=32)
    head_sets = _pruned_head_sets(run, base, rankings)
    found = proposition1(base, clean, noisy, head_sets, probes=config.probes, seed=config.seed, progress=True)
    return {
        "clean": f"{len(clean_data)} ID validation items",
        "noisy": f"the same items, {CORRUPTION[config.task]} severity {config.severity}",
        "parameters": "W_Q, W_K, W_V (and biases), W_O of every layer",
        "results": {name: result.to_dict() for name, result in found.items()},
    }


def _heads(run: DemoRun, config: AnalysisConfig, base, rankings: Rankings, out: Path) -> dict[str, Any]:
    counts = original_heads_per_layer(base)
    last = len(counts) - 1
    circ = rankings.circuit.head_set(run.config.num_pruned)
    kept = set(circ.resolve(counts)[last])
    steps = removal_ranking(rankings.circuit)[last]
    models = {"dense": base, "CircAvg (pruned, not fine-tuned)": prune(base, circ)}
    per_model: dict[str, Any] = {}
    vectors: dict[str, dict[str, Any]] = {}
    for label, model in models.items():
        id_vectors = head_vectors(model, run.bench.test)
        vectors[label] = {"ID test": id_vectors}
        rows: dict[str, Any] = {}
        for name, (kind, batches) in run.bench.oods.items():
            ood_vectors = head_vectors(model, batches)
            vectors[label][name] = ood_vectors
            distances = centroid_distances(id_vectors.vectors, ood_vectors.vectors)
            rows[name] = {
                "kind": kind,
                "heads": {str(h): d for h, d in zip(id_vectors.heads, distances, strict=True)},
            }
        per_model[label] = rows
    summary = {}
    for label, rows in per_model.items():
        heads = [int(h) for h in next(iter(rows.values()))["heads"]]
        groups = {"all heads": heads}
        if label == "dense":
            groups |= {
                "kept by the circuit": [h for h in heads if h in kept],
                "removed by the circuit": [h for h in heads if h not in kept],
            }
        for group, chosen in groups.items():
            if chosen:
                summary[f"{label}: {group}"] = {
                    metric: float(np.mean([rows[s]["heads"][str(h)][metric] for s in rows for h in chosen]))
                    for metric in ("euclidean", "mahalanobis")
                } | {"heads": len(chosen)}
    near = next((n for n, (kind, _) in run.bench.oods.items() if kind == "near"), next(iter(run.bench.oods)))
    panels = _head_panels(vectors["dense"], near, steps, rankings.taylor[last])
    reporting.head_scatter(panels, out / "plots" / "head_pca.png", labels=("ID test", near))
    return {
        "layer": last,
        "circuit_keeps": sorted(kept),
        "removal_step": {str(h): (None if np.isinf(s) else int(s)) for h, s in enumerate(steps)},
        "summary": summary,
        "per_head": per_model,
        "plot": "plots/head_pca.png",
    }


def _head_panels(dense: dict[str, Any], near: str, steps: np.ndarray, taylor: torch.Tensor) -> list[tuple]:
    """The paper's Figure 4: the most and least important heads of the last layer of the dense
    model, ID test vs near-OOD in PCA. Importance: removed later = more important; heads the
    circuit never removed (it ranks only its budget) come first, ordered by their Taylor score."""
    order = sorted(range(len(steps)), key=lambda h: (-steps[h], -float(taylor[h]), h))
    panels = []
    show = min(3, len(steps) // 2)
    for rank, head in [*((i, h) for i, h in enumerate(order[:show])), *((-1, h) for h in order[-show:])]:
        points = np.concatenate([dense["ID test"].vectors[:, head], dense[near].vectors[:, head]])
        projected = pca_2d(points)
        n = len(dense["ID test"].vectors)
        what = "never removed" if np.isinf(steps[head]) else f"removed at step {int(steps[head])}"
        title = f"{'most' if rank >= 0 else 'least'} important: head {head} ({what})"
        panels.append((title, projected[:n], projected[n:]))
    return panels


def _evaluate(
    run: DemoRun, models: dict[str, Any], bootstrap: int, seed: int, known: PredictionCache
) -> tuple[dict[str, Any], dict[str, Any]]:
    """ID test and OOD test metrics (with bootstrap draws) of ``models`` (name -> model)."""
    data = EvalData(run.bench.test, run.bench.oods)
    precision = run.evaluation.name
    results, draws = {}, {}
    for name, model in models.items():
        preds = predict_method(
            model, data, lambda m, b, split: known.predict(m, b, split, precision=precision, progress=False)
        )
        rows, _, row_draws = evaluate_method(name, preds, bootstrap, seed)
        results.update(rows)
        draws.update(row_draws)
    return results, draws


def _circ_members(run: DemoRun, base, rankings: Rankings, count: int) -> list[torch.nn.Module]:
    """The first ``count`` Hydra (Circ) members (nested: member m is the same for any count)."""
    heads = run.config.sample_member_heads(rankings.circuit, count=count)
    return [pruned_member(run, base, f"circ member {m}", hs, m) for m, hs in enumerate(heads)]


def _members(run: DemoRun, config: AnalysisConfig, base, rankings: Rankings, out: Path) -> dict[str, Any]:
    members = _circ_members(run, base, rankings, config.max_members)
    singles = [trained_single(run, s) for s in range(config.max_members)]
    counts = range(2, config.max_members + 1)
    models = {}
    for m in counts:
        models[f"Hydra (Circ), M={m}"] = fuse(members[:m], mlp="merge").eval()
        models[f"Deep Ensemble, M={m}"] = DeepEnsemble(singles[:m])
    known = run.cache.predictions()
    results, draws = _evaluate(run, {"Single": base, **models}, config.bootstrap, config.seed, known)
    add_comparisons(results, draws, [(f"Hydra (Circ), M={m}", f"Deep Ensemble, M={m}") for m in counts])
    cost = cost_table({"Single": base, **models}, run.bench.test[0], run.config, run.compute)
    curves: dict[str, dict[str, list]] = {}
    for metric, key in (("accuracy", "acc"), ("NLL", "nll"), ("ECE", "ece"), ("AUROC", "auroc")):
        for family in ("Hydra (Circ)", "Deep Ensemble"):
            curves.setdefault(metric, {})[family] = [
                (m, reporting_value(results[f"{family}, M={m}"], key)) for m in counts
            ]
    for metric, key in (("latency (ms)", "median_ms"), ("GMACs", "gmacs")):
        for family in ("Hydra (Circ)", "Deep Ensemble"):
            curves.setdefault(metric, {})[family] = [
                (m, cost["methods"][f"{family}, M={m}"][key]) for m in counts
            ]
    reporting.metrics_vs_pruned(curves, out / "plots" / "members.png", xlabel="members M")
    return {"results": results, "cost": cost, "plot": "plots/members.png"}


def reporting_value(row: dict[str, Any], key: str) -> float:
    """A main-table value of a result row (ID metric, or the OOD average for MSP)."""
    return float(main_row(row)[key])


def _merge(run: DemoRun, config: AnalysisConfig, base, rankings: Rankings, out: Path) -> dict[str, Any]:
    members = _circ_members(run, base, rankings, run.config.members)
    models = {
        "Hydra (Circ), merged MLPs": fuse(members, mlp="merge").eval(),
        "Hydra (Circ), exact": fuse(members, mlp="exact").eval(),
        "Hydra (Circ), members one by one": DeepEnsemble(members),
    }
    results, draws = _evaluate(run, models, config.bootstrap, config.seed, run.cache.predictions())
    names = list(models)
    add_comparisons(results, draws, [(names[0], names[1]), (names[0], names[2])])
    return {"results": results}


# --------------------------------------------------------------------------- report
def analysis_report(results: dict[str, Any]) -> str:
    """The studies as Markdown."""
    meta = results["meta"]
    parts = ["# Hydra Ensembles: analysis", ""]
    parts += [f"- **{k}**: {v if not isinstance(v, dict) else json.dumps(v)}" for k, v in meta.items()] + [""]
    if "prop1" in results:
        study = results["prop1"]
        parts += [
            "## Proposition 1's conditions (paper B.1)",
            "",
            f"Clean data: {study['clean']}; noisy: {study['noisy']}; parameters: {study['parameters']}. "
            "Proposition 1 needs alignment grad L_n · δ ≥ 0 and H_n − H_t ≻ 0 (tested along δ, and on "
            "the diagonal over δ's support with Hutchinson's estimator ± its standard error).",
            "",
            reporting.markdown_table(
                PROP1_HEADERS, [_prop1_row(name, r) for name, r in study["results"].items()]
            ),
            "",
        ]
    if "heads" in results:
        study = results["heads"]
        parts += [
            f"## What last-layer heads represent (paper B.2; layer {study['layer']})",
            "",
            f"The CircAvg circuit keeps heads {study['circuit_keeps']} of this layer. Mean centroid "
            "distances between ID test and every OOD test set ([CLS] vector of each head; Mahalanobis "
            "under the Ledoit-Wolf ID covariance):",
            "",
            reporting.markdown_table(
                ["Model: heads", "Heads", "Euclidean", "Mahalanobis"],
                [
                    [label, str(row["heads"]), f"{row['euclidean']:.3f}", f"{row['mahalanobis']:.3f}"]
                    for label, row in study["summary"].items()
                ],
            ),
        ]
        parts += ["", f"PCA of the most and least important heads: `{study['plot']}`", ""]
    if "members" in results:
        study = results["members"]
        parts += ["## Member count (paper B.6)", "", _main_table(study["results"], study["cost"]), ""]
        parts += [f"Curves: `{study['plot']}`", ""]
        parts += reporting.interval_sections(study["results"])
    if "merge" in results:
        study = results["merge"]
        parts += ["## Merged MLPs vs exact fusion (paper B.7)", "", _main_table(study["results"]), ""]
        parts += reporting.interval_sections(study["results"])
    return "\n".join(parts)


PROP1_HEADERS = [
    "Head set",
    "Heads removed",
    "grad L_n · δ",
    "grad L_t · δ",
    "½ δᵀ(H_n − H_t)δ",
    "diag(H_n − H_t) on δ's support",
    "share > 0",
    "predicted Δgap",
    "measured Δgap",
]


def _prop1_row(name: str, r: dict[str, Any]) -> list[str]:
    """One head set's row of the Proposition 1 table."""
    return [
        name,
        str(r["heads_removed"]),
        f"{r['alignment_noisy']:.4f}",
        f"{r['alignment_clean']:.4f}",
        f"{r['curvature_gap']:.4f}",
        f"{r['diagonal_gap']:.2e} ± {r['diagonal_gap_stderr']:.1e} ({r['probes']} probes)",
        f"{100 * r['diagonal_gap_positive']:.0f}%",
        f"{r['predicted_gap_change']:.4f}",
        f"{r['measured_gap_change']:.4f}",
    ]


def _main_table(results: dict[str, Any], cost: dict[str, Any] | None = None) -> str:
    columns = [c for c in reporting.MAIN_COLUMNS if c[0] in ("acc", "nll", "ece", "auroc", "fpr95")]
    headers = ["Method", *(h for _, h, _ in columns), "MI (ID)", "disagreement (ID)"]
    if cost:
        headers += ["latency (ms)", "params (M)", "GMACs"]
    rows = []
    for name, row in results.items():
        cells = [name] + [reporting.format_value(k, reporting_value(row, k)) for k, _, _ in columns]
        div = row.get("diversity", {}).get("id")  # single models have no diversity
        cells += (
            [f"{div['mutual_information']:.4f}", f"{100 * div['disagreement']:.2f}"] if div else ["–", "–"]
        )
        if cost:
            c = cost["methods"].get(name)
            cells += (
                [f"{c['median_ms']:.0f}", f"{c['params'] / 1e6:.1f}", f"{c['gmacs']:.1f}"] if c else ["–"] * 3
            )
        rows.append(cells)
    return reporting.markdown_table(headers, rows)


def analysis_config(task: str = "text", **overrides) -> AnalysisConfig:
    """The default analysis of ``task`` on the demo's default configuration (and cache)."""
    demo_fields = {
        k: overrides.pop(k) for k in list(overrides) if k in ("cache_dir", "use_cache", "precision")
    }
    demo = replace(DemoConfig.preset(task), **demo_fields)
    return AnalysisConfig(task=task, demo=demo, **overrides)


__all__ = ["STUDIES", "AnalysisConfig", "analysis_config", "analysis_report", "run_analysis"]
