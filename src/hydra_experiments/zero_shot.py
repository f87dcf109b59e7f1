"""The paper's zero-shot experiment (section 5.3) on an embedded benchmark (``hydra-ens demo
--task zero-shot``).

No CLIP weights exist offline here, so the dual encoder is the embedded sentence encoder
all-MiniLM-L6-v2 (a contrastively trained dual encoder): the input tower embeds a news text, the
label tower (a second copy of the same weights, pruned separately) embeds "This news article is
about {topic}." for each topic, and logits are 20 x cosine (the scale of its contrastive training
loss). Data are the text task's: ID = BBC News in 4 topics, near-OOD = the held-out topic, far-OOD
= drug reviews and fortunes, OOD validation for circuit extraction = SpamAssassin. Nothing is
trained: Taylor scores (zero-shot cross-entropy) and circuits use the ID validation split, and
temperature scaling is fit on it.

Methods: Single, Single + TS, Taylor and CircAvg (one pruned model each), Hydra (Circ) over the
heads of both towers, Hydra (Circ) over the input tower only (paper E.3.2), Hydra (Taylor). Each
pruned model and member prunes the same number of heads.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import AutoModel

from hydra_ensembles.heads import HeadSet
from hydra_ensembles.models import load_tokenizer, resolve_model_path
from hydra_ensembles.scoring import CircuitOrder
from hydra_ensembles.surgery import original_heads_per_layer, prune
from hydra_ensembles.zero_shot import DualEncoderClassifier, from_sentence_encoder, fuse_dual_encoder

from .cache import Cache
from .config import DemoConfig
from .report import cost_table, evaluate_all, pruning_curves, report_meta, write_report
from .stages import rank_model, start_run
from .state import DemoRun, Method, PrunedModels, Rankings

TEMPLATES = ("This news article is about {}.", "A news story about {}.", "{} news.")
"""Prompt templates for the BBC topics (averaged per class, as CLIP averages its 80)."""


def zero_shot_classifier(
    config: DemoConfig, classes: list[str], heads: str = "both"
) -> DualEncoderClassifier:
    """The demo's dual encoder over ``config.model`` (a sentence-transformers checkpoint)."""
    path = resolve_model_path(config.model)
    encoder = AutoModel.from_pretrained(path).eval()
    return from_sentence_encoder(encoder, load_tokenizer(config.model), classes, TEMPLATES, heads=heads)


def run_zero_shot_demo(config: DemoConfig, cache: Cache | None = None) -> dict[str, Any]:
    """Run the zero-shot experiment; returns the results and writes the report folder. ``cache``:
    where rankings are kept (default: the configuration's cache folder)."""
    run = start_run(config, cache)
    classes = run.task.classes
    dual = run.stage.run("load the dual encoder", lambda: zero_shot_classifier(config, classes))
    dual_input = zero_shot_classifier(config, classes, heads="input")
    rankings = _rank(run, dual, "both")
    input_circuit = _rank(run, dual_input, "input").circuit
    pruned = _prune(run, dual, dual_input, rankings, input_circuit)
    single = fuse_dual_encoder(dual_input, [HeadSet.full(original_heads_per_layer(dual_input))])
    methods = table_methods(run, dual, dual_input, pruned, single)
    known = run.cache.predictions()
    preds, results, heads, temperatures = evaluate_all(run, methods, known)
    curves = run.stage.run(
        "training-free pruning curves",
        lambda: pruning_curves(dual, {"Taylor": rankings.taylor, "CircAvg": rankings.circuit}, run, known),
    )
    # Single as deployed: the input tower and cached class embeddings (the label tower never runs)
    timed = {"Single": single, **{m.cost_name: m.model for m in methods if m.cost_name}}
    cost = run.stage.run("cost benchmark", lambda: cost_table(timed, run.bench.test[0], config, run.compute))
    meta = _meta(run, dual, temperatures, pruned)
    write_report(run, methods, results, heads, preds, meta, cost, curves, rankings, pruned)
    return {"results": results, "cost": cost, "meta": {**meta, "wall_s": run.stage.elapsed}}


def _rank(run: DemoRun, model: DualEncoderClassifier, pool: str) -> Rankings:
    """Taylor scores (zero-shot cross-entropy on ID validation texts), Taylor's per-layer head set
    pruning as many heads as the members, and the CircAvg order over ``pool``'s heads."""
    counts = original_heads_per_layer(model)
    keep = counts[0] - run.config.num_pruned // len(counts)
    key = {**run.bench.key, "zero-shot": list(TEMPLATES), "pool": pool, "precision": run.compute.name}
    return rank_model(run, model, run.bench.val[:1], keep, key, kind="zs-", label=pool)


def _prune(run: DemoRun, dual, dual_input, rankings: Rankings, input_circuit: CircuitOrder) -> PrunedModels:
    """The single pruned models and the fused zero-shot Hydras (no fine-tuning anywhere)."""
    config = run.config
    sample = config.sample_member_heads

    member_heads = {
        "taylor": sample(rankings.taylor),
        "circ": sample(rankings.circuit),
        "circ-input": sample(input_circuit),
    }
    singles = {
        "Taylor": prune(dual, rankings.taylor_single),
        "CircAvg": prune(dual, rankings.circuit.head_set(config.num_pruned)),
    }
    hydras = run.stage.run(
        "fuse zero-shot Hydras",
        lambda: {
            "Hydra (Taylor)": fuse_dual_encoder(dual, member_heads["taylor"]),
            "Hydra (Circ)": fuse_dual_encoder(dual, member_heads["circ"]),
            "Hydra (Circ, input tower)": fuse_dual_encoder(dual_input, member_heads["circ-input"]),
        },
    )
    return PrunedModels(singles, member_heads, hydras)


def table_methods(run: DemoRun, dual, dual_input, pruned: PrunedModels, single) -> list[Method]:
    """The zero-shot table, in order."""
    config = run.config
    counts, input_counts = original_heads_per_layer(dual), original_heads_per_layer(dual_input)
    both = f"{sum(counts) - config.num_pruned}/{sum(counts)}"
    only_input = f"{sum(input_counts) - config.num_pruned}/{sum(input_counts)} + label {sum(input_counts)}"
    return [
        Method("Single", dual_input, f"{sum(counts)}/{sum(counts)}", calibrate=True, reliability=True),
        Method("Taylor (single pruned)", pruned.singles["Taylor"], both),
        Method("CircAvg (single pruned)", pruned.singles["CircAvg"], both, compare_with=("Single",)),
        Method("Hydra (Taylor)", pruned.hydras["Hydra (Taylor)"], both),
        Method(
            "Hydra (Circ)",
            pruned.hydras["Hydra (Circ)"],
            both,
            calibrate=True,
            cost_name="Hydra (Circ)",
            reliability=True,
            detail=True,
            compare_with=("Single",),
        ),
        Method(
            "Hydra (Circ, input tower)",
            pruned.hydras["Hydra (Circ, input tower)"],
            only_input,
            cost_name="Hydra (Circ, input tower)",
            compare_with=("Single",),
        ),
    ]


def _meta(run: DemoRun, dual, temperatures: dict[str, Any], pruned: PrunedModels) -> dict[str, str]:
    meta = report_meta(run, dual, temperatures, pruned.member_heads)
    meta.pop("training recipe (all methods)", None)
    meta["seeds"] = f"member sampling seed {run.config.seed}"
    counts = original_heads_per_layer(dual)
    meta["zero-shot"] = (
        f"dual encoder: input tower and label tower are two copies of {run.config.model}, pruned "
        f"separately ({len(counts)} layers x {counts[0]} heads across both); prompts {json.dumps(TEMPLATES)} "
        f"averaged per class; logits = {dual.config.logit_scale:g} x cosine; no training"
    )
    meta["members"] = (
        f"{run.config.members} members, each pruning {run.config.num_pruned} heads drawn from "
        f"the {run.config.pool_size} least useful of its ranking (seed {run.config.seed})"
    )
    return meta
