"""Plots a person would rather look at than read (PNG, matplotlib, written atomically)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.metrics import roc_curve

from ..heads import HeadSet
from ..saving.files import atomic_write

if TYPE_CHECKING:
    from ..evaluation.run import MethodPredictions


def _save(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    out = atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return out


def reliability_diagram(
    probs_by_method: Mapping[str, np.ndarray], labels: np.ndarray, path, n_bins: int = 15
) -> Path:
    """Accuracy against confidence per equal-width bin, one panel per method."""
    methods = list(probs_by_method)
    fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.2), squeeze=False)
    edges = np.linspace(0, 1, n_bins + 1)
    for ax, method in zip(axes[0], methods, strict=True):
        probs = probs_by_method[method]
        conf, correct = probs.max(-1), probs.argmax(-1) == labels
        index = np.minimum((conf * n_bins).astype(int), n_bins - 1)
        accs = [correct[index == b].mean() if (index == b).any() else np.nan for b in range(n_bins)]
        ax.bar(edges[:-1], accs, width=1 / n_bins, align="edge", edgecolor="black", label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ax.set(title=method, xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
    axes[0][0].legend(loc="upper left", fontsize=7)
    return _save(fig, path)


def confidence_histograms(conf_by_set: Mapping[str, np.ndarray], path, title: str = "") -> Path:
    """Histograms of top-label confidence, one curve per dataset (ID and OOD sets)."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    bins = np.linspace(0, 1, 26)
    for name, conf in conf_by_set.items():
        ax.hist(conf, bins=bins, histtype="step", density=True, lw=1.5, label=name)
    ax.set(title=title or "confidence", xlabel="max softmax probability", ylabel="density")
    ax.legend(fontsize=7)
    return _save(fig, path)


SCORE_LABELS = {
    "msp": "1 - max softmax probability",
    "max_logit": "- max logit",
    "energy": "- energy (free energy, sign flipped)",
    "entropy": "predictive entropy (nats)",
    "mutual_information": "mutual information (nats)",
}


def score_histograms(
    scores_by_set: Mapping[str, np.ndarray], path, score: str, threshold: float | None = None, title: str = ""
) -> Path:
    """Histograms of an OOD score (higher = more OOD) per dataset, with the flag threshold."""
    fig, ax = plt.subplots(figsize=(5, 3.2))
    values = np.concatenate([np.asarray(v, dtype=float) for v in scores_by_set.values()])
    bins = np.linspace(values.min(), values.max(), 31) if np.ptp(values) > 0 else 10
    for name, scores in scores_by_set.items():
        ax.hist(scores, bins=bins, histtype="step", density=True, lw=1.5, label=name)
    if threshold is not None:
        ax.axvline(threshold, color="k", ls="--", lw=1, label=f"flag above {threshold:.3g}")
    ax.set(
        title=title or f"{score} (higher = more likely OOD)",
        xlabel=SCORE_LABELS.get(score, score),
        ylabel="density",
    )
    ax.legend(fontsize=7)
    return _save(fig, path)


def roc_curves(
    id_scores: np.ndarray, ood_scores_by_set: Mapping[str, np.ndarray], path, title: str = ""
) -> Path:
    """ROC curves, ID vs each OOD set (OOD positive; scores higher = more OOD)."""
    fig, ax = plt.subplots(figsize=(4, 4))
    for name, scores in ood_scores_by_set.items():
        y = np.r_[np.zeros(len(id_scores)), np.ones(len(scores))]
        fpr, tpr, _ = roc_curve(y, np.r_[id_scores, scores])
        ax.plot(fpr, tpr, label=name)
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set(title=title or "ROC (OOD positive)", xlabel="FPR (ID flagged)", ylabel="TPR (OOD caught)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def heads_map(
    head_sets: Sequence[HeadSet], original_heads_per_layer: Sequence[int], path, names=None
) -> Path:
    """Layers x heads grid per member: kept (dark) or pruned (light)."""
    m = len(head_sets)
    fig, axes = plt.subplots(
        1, m, figsize=(2.2 * m + 0.5, 0.35 * len(original_heads_per_layer) + 1.2), squeeze=False
    )
    for i, (ax, hs) in enumerate(zip(axes[0], head_sets, strict=True)):
        ax.imshow(np.array(hs.mask(original_heads_per_layer)), cmap="Greys", vmin=0, vmax=1.4, aspect="auto")
        ax.set(title=(names[i] if names else f"member {i}"), xlabel="head", ylabel="layer")
    return _save(fig, path)


def score_heatmap(scores: np.ndarray, path, title: str, label: str = "score") -> Path:
    """A (layers, heads) heatmap, e.g. Taylor scores or circuit removal steps."""
    fig, ax = plt.subplots(figsize=(0.45 * scores.shape[1] + 1.5, 0.4 * scores.shape[0] + 1.2))
    image = ax.imshow(np.ma.masked_invalid(scores), cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label=label)
    ax.set(title=title, xlabel="head", ylabel="layer")
    return _save(fig, path)


def metrics_vs_pruned(
    curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]], path, xlabel: str = "heads pruned"
) -> Path:
    """The paper's Figure 5: each metric against the number of heads pruned (or another
    ``xlabel``, e.g. members), one line per method.

    ``curves[metric][method]`` is a list of (x, value).
    """
    metrics = list(curves)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for method, points in curves[metric].items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=method)
        ax.set(title=metric, xlabel=xlabel)
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def frontier_plot(
    rows: Sequence[Mapping],
    path,
    metrics: Sequence[tuple[str, str, Sequence[bool]]],
    budget: float | None = None,
    chosen: int | None = None,
    title: str = "",
) -> Path:
    """Each configuration's quality against its cost (``latency_ratio``), one panel per
    (metric key, axis label, which rows are on that metric's frontier) of ``metrics``; the
    frontier's points joined and ringed, the budget a dashed line, the chosen configuration a star;
    where the rows hold their paired 95% intervals against the single model (``<key>_vs_single_low``
    and ``_high``), each point carries its interval and the single model's level is a line, so a
    difference inside the noise shows as one."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.8), squeeze=False)
    costs = np.array([float(r["latency_ratio"]) for r in rows])
    for ax, (key, label, on_frontier) in zip(axes[0], metrics, strict=True):
        values = np.array([np.nan if r.get(key) is None else float(r[key]) for r in rows])
        ax.scatter(costs, values, color="tab:blue", zorder=2)
        if all(f"{key}_vs_single_low" in r for r in rows):  # the paired 95% interval of each difference
            below = [r[f"{key}_vs_single"] - r[f"{key}_vs_single_low"] for r in rows]
            above = [r[f"{key}_vs_single_high"] - r[f"{key}_vs_single"] for r in rows]
            ax.errorbar(
                costs, values, yerr=[below, above], fmt="none", ecolor="tab:blue", alpha=0.5, zorder=1
            )
            ax.axhline(values[0], color="gray", linewidth=0.8, label="single model")
        front = sorted(i for i, on in enumerate(on_frontier) if on)
        front.sort(key=lambda i: costs[i])
        ax.plot(costs[front], values[front], color="tab:orange", zorder=1, label="frontier")
        ax.scatter(costs[front], values[front], s=90, facecolors="none", edgecolors="tab:orange", zorder=3)
        if chosen is not None:
            ax.scatter(
                [costs[chosen]],
                [values[chosen]],
                marker="*",
                s=220,
                color="tab:red",
                zorder=4,
                label="chosen",
            )
        if budget is not None:
            ax.axvline(budget, color="gray", linestyle="--", label=f"budget {budget:g}x")
        for i, row in enumerate(rows):
            ax.annotate(
                str(row["name"]), (costs[i], values[i]), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
        ax.set(xlabel="latency / single model's (same run)", ylabel=label)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def head_scatter(
    panels: Sequence[tuple[str, np.ndarray, np.ndarray]], path, columns: int = 3, labels=("ID", "OOD")
) -> Path:
    """One 2-D scatter per panel (title, ID points (N, 2), OOD points (K, 2)): e.g. the PCA of
    the most and least important heads' [CLS] vectors (the paper's Figure 4)."""
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3 * columns, 2.8 * rows), squeeze=False)
    for ax, (title, inside, outside) in zip(axes.flat, panels, strict=False):
        ax.scatter(*inside.T, s=6, alpha=0.6, label=labels[0])
        ax.scatter(*outside.T, s=6, alpha=0.6, label=labels[1])
        ax.set_title(title, fontsize=8)
        ax.set_xticks([]), ax.set_yticks([])
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    return _save(fig, path)


def slug(name: str) -> str:
    """A file-name part for a method name: ``"Hydra (Circ)"`` -> ``"hydra_circ"``."""
    return "_".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def method_plots(
    folder: str | os.PathLike,
    preds: Mapping[str, MethodPredictions],
    reliability: Sequence[str],
    detail: Sequence[str],
) -> list[Path]:
    """A method report's figures in ``folder``: one reliability diagram of the ``reliability``
    methods, and, for each ``detail`` method with OOD sets, MSP confidence histograms and ROC
    curves (ID test against each OOD set)."""
    from ..evaluation.evaluate import ood_scores

    folder = Path(folder)
    labels = preds[reliability[0]].test.labels
    written = [
        reliability_diagram(
            {name: preds[name].test.probs() for name in reliability}, labels, folder / "reliability.png"
        )
    ]
    for name in detail:
        p = preds[name]
        if not p.ood:
            continue
        conf = {"ID test": p.test.probs().max(-1), **{n: q.probs().max(-1) for n, (_, q) in p.ood.items()}}
        written.append(
            confidence_histograms(conf, folder / f"confidence_{slug(name)}.png", f"{name}: confidence")
        )
        written.append(
            roc_curves(
                ood_scores(p.test, "msp"),
                {n: ood_scores(q, "msp") for n, (_, q) in p.ood.items()},
                folder / f"roc_{slug(name)}.png",
                f"{name}, MSP",
            )
        )
    return written
