"""Every layer's view of an input: does the ensemble's M x L feature views detect OOD better than
the single model's L, with the same detector?

On the text demo's data and models (`hydra-ens demo`'s default scale: Single, the deep ensemble of
M fine-tuned models, Hydra (Circ); trained once and kept in ``--cache``), each model's [CLS]
feature after every transformer layer is read for every member, and the Mahalanobis score
(``mds``: one covariance shared by the classes) is fit per member and layer on the ID training
features. Detectors compared, the same for every model:

* ``classifier input``: ``mds`` on what the task head reads (the library's shipped feature);
* ``layer l``: ``mds`` on layer l's [CLS] feature;
* ``all layers``: each member's per-layer scores standardised by their mean and spread on the ID
  training data, averaged over the layers (fit on ID training data only);
* ``max layer``: the largest of those standardised per-layer scores;
* ``weighted layers``: a logistic regression of ID validation against the OOD validation set
  (SpamAssassin, never an OOD test set) on the standardised scores, one weight per member and
  layer: the weights are what OOD validation data says about the layers;

each averaged over the members. AUROC (OOD positive) of ID test against each OOD test set, with a
paired bootstrap of Hydra minus Single on the same inputs. Nothing is chosen on OOD data.

    python benchmarks/layer_scores.py --seeds 0,1,2 [--cache runs/layer-scores]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from hydra_ensembles.build import BuildConfig, build_hydra
from hydra_ensembles.evaluation import predict
from hydra_ensembles.fusion import fuse
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.metrics import auroc
from hydra_ensembles.models import offline_by_default
from hydra_ensembles.ood import FeatureStatistics
from hydra_ensembles.saving.files import atomic_write_json
from hydra_ensembles.surgery import prune
from hydra_experiments.config import DemoConfig
from hydra_experiments.stages import pruned_member, rank_heads, start_run, trained_single

BOOTSTRAP = 1000


def _model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


@torch.no_grad()
def layer_features(model, batches: list[dict]) -> np.ndarray:
    """(M, N, L, D) float32: every member's [CLS] feature after each transformer layer (a list of
    models: one member each; a fused model: its M members from one pass)."""
    if isinstance(model, list):
        return np.concatenate([layer_features(m, batches) for m in model])
    fused = hasattr(model, "head_sets")
    if fused:
        model.chunk_rows = None  # one pass per batch: one hook call per layer
    parts = []
    for batch in batches:
        x = _model_inputs(batch)
        if fused:
            seen: list[torch.Tensor] = []

            def keep(_module, _args, out, seen=seen):
                hidden = out[0] if isinstance(out, tuple) else out  # (M * B, T, D)
                seen.append(hidden[:, 0])

            hooks = [layer.register_forward_hook(keep) for layer in model.adapter.layers(model.model)]
            try:
                model(**x)
            finally:
                for hook in hooks:
                    hook.remove()
            rows = len(next(iter(x.values())))
            parts.append(torch.stack([h.float().view(model.num_members, rows, -1) for h in seen], 2))
        else:
            states = model(**x, output_hidden_states=True).hidden_states[1:]
            parts.append(torch.stack([h[:, 0].float() for h in states], 1)[None])
    return torch.cat(parts, 1).numpy()


def _labels(batches: list[dict]) -> np.ndarray:
    return torch.cat([b["labels"] for b in batches]).numpy()


def member_layer_scores(train: np.ndarray, labels: np.ndarray, classes: int, split: np.ndarray) -> np.ndarray:
    """(M, N, L) ``mds`` of ``split``'s features per member and layer, fit per layer on ``train``."""
    per_layer = []
    for layer in range(train.shape[2]):
        stats = FeatureStatistics.fit(train[:, :, layer], labels, classes, scores=("mds",))
        per_layer.append(stats.member_scores("mds", torch.from_numpy(split[:, :, layer])).numpy())
    return np.stack(per_layer, -1)


def detectors(model, run, classes: int) -> dict[str, dict[str, np.ndarray]]:
    """Detector name -> split name -> ensemble score (N,), for ID test and each OOD test set."""
    bench = run.bench
    splits = {
        "test": bench.test,
        "val": bench.val,
        "ood_val": bench.ood_val,
        **{name: batches for name, (_, batches) in bench.oods.items()},
    }
    train_labels = _labels(bench.train)
    train = layer_features(model, bench.train)
    reference = member_layer_scores(train, train_labels, classes, train)
    mean, spread = reference.mean(1, keepdims=True), reference.std(1, keepdims=True) + 1e-12
    out: dict[str, dict[str, np.ndarray]] = {}
    trained = predict(model, bench.train, progress=False, precision="fp32")
    head = FeatureStatistics.fit(trained.member_features, train_labels, classes, scores=("mds",))
    standardised = {}
    for split, batches in splits.items():
        scores = member_layer_scores(train, train_labels, classes, layer_features(model, batches))
        standardised[split] = (scores - mean) / spread  # (M, N, L)
        out.setdefault("all layers", {})[split] = standardised[split].mean(-1).mean(0)
        out.setdefault("max layer", {})[split] = standardised[split].max(-1).mean(0)
        for layer in range(scores.shape[-1]):
            out.setdefault(f"layer {layer + 1}", {})[split] = scores[..., layer].mean(0)
        features = predict(model, batches, progress=False, precision="fp32").member_features
        out.setdefault("classifier input", {})[split] = head.member_scores("mds", features).numpy().mean(0)
    views = {k: v.transpose(1, 0, 2).reshape(v.shape[1], -1) for k, v in standardised.items()}  # (N, M*L)
    fit = LogisticRegression(C=1.0, max_iter=1000).fit(
        np.concatenate([views["val"], views["ood_val"]]),
        np.r_[np.zeros(len(views["val"])), np.ones(len(views["ood_val"]))],
    )
    out["weighted layers"] = {k: fit.decision_function(v) for k, v in views.items()}
    return out


def _auroc(scores: dict[str, np.ndarray], ood: str, index=None) -> float:
    ident, other = scores["test"], scores[ood]
    if index is not None:
        ident, other = ident[index[0]], other[index[1]]
    return 100 * auroc(ident, other)


def compare(results: dict[str, dict], oods: list[str], seed: int) -> dict[str, dict]:
    """Per detector: each model's mean AUROC over the OOD sets, and Hydra minus Single's paired
    bootstrap 95% interval (the same resampled ID and OOD inputs for both)."""
    rng = np.random.default_rng(seed)
    table = {}
    for detector in results["Single"]:
        row = {m: float(np.mean([_auroc(results[m][detector], o) for o in oods])) for m in results}
        row["Hydra - Single"] = _paired(results, "Hydra (Circ)", detector, oods, rng)
        for other in [m for m in results if m.startswith("Hydra (Circ),")]:
            row[f"{other} - Single"] = _paired(results, other, detector, oods, rng)
        table[detector] = row
    return table


def _paired(results: dict, model: str, detector: str, oods: list[str], rng) -> list[float]:
    """The paired bootstrap 95% interval of ``model`` minus Single's mean AUROC over ``oods``."""
    diffs = []
    for _ in range(BOOTSTRAP):
        draws = []
        for o in oods:
            n_id, n_ood = len(results["Single"][detector]["test"]), len(results["Single"][detector][o])
            index = (rng.integers(0, n_id, n_id), rng.integers(0, n_ood, n_ood))
            draws.append(
                _auroc(results[model][detector], o, index) - _auroc(results["Single"][detector], o, index)
            )
        diffs.append(np.mean(draws))
    return [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]


def run_seed(seed: int, cache: Path, variants: bool = False) -> dict:
    config = DemoConfig.preset("text", seed=seed, out_dir=cache / f"seed-{seed}", cache_dir=cache / "models")
    run = start_run(config)
    singles = [trained_single(run, s) for s in range(config.members)]
    base = singles[0]
    rankings = rank_heads(run, base)
    settings = BuildConfig(
        num_members=config.members,
        num_pruned=config.num_pruned,
        pool_size=config.pool_size,
        seed=config.seed,
        mlp="merge",
    )
    built = build_hydra(
        base,
        config=settings,
        ranking=rankings.circuit,
        make_member=lambda m, hs: pruned_member(run, base, f"circ member {m}", hs, m),
    )
    classes = len(run.task.classes)
    models = {"Single": base, "Deep Ensemble": singles, "Hydra (Circ)": built.hydra.eval()}
    if variants:  # the same fine-tuned members fused otherwise (the paper averages their MLPs)
        models["Hydra (Circ), exact members"] = fuse(built.members, mlp="exact").eval()
        whole = prune(base, HeadSet({}))  # Single itself, as a member that keeps every head
        models["Hydra (Circ), base as member 0"] = fuse([whole, *built.members[1:]], mlp="exact").eval()
    results = {name: detectors(model, run, classes) for name, model in models.items()}
    return compare(results, list(run.bench.oods), seed)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--cache", default="runs/layer-scores")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also Hydra (Circ)'s members fused exactly (each its own MLP) and with Single as member 0",
    )
    args = parser.parse_args()
    offline_by_default()
    cache = Path(args.cache)
    per_seed = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        per_seed[seed] = run_seed(seed, cache, args.variants)
        print(f"\nseed {seed}: mean AUROC over the OOD test sets (Hydra - Single: paired bootstrap 95%)")
        for detector, row in per_seed[seed].items():
            cells = ", ".join(f"{m} {v:.2f}" for m, v in row.items() if not m.endswith(" - Single"))
            gaps = "; ".join(
                f"{m} [{v[0]:+.2f}, {v[1]:+.2f}]" for m, v in row.items() if m.endswith(" - Single")
            )
            print(f"  {detector:17s} {cells}; {gaps}")
        atomic_write_json(cache / "layer_scores.json", per_seed)


if __name__ == "__main__":
    main()
