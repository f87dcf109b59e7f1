"""The demo's stages: train the baselines, rank the heads, build the pruned models and the Hydra
models, list the methods of the table."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from hydra_ensembles.baselines.unstructured import make_permanent, matched_sparsity, unstructured_prune
from hydra_ensembles.batching import bootstrap_batches, pad_id
from hydra_ensembles.build import Build, BuildConfig, build_hydra, narrow_mlp
from hydra_ensembles.cost import count_parameters
from hydra_ensembles.fusion import fuse
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.members.ensemble import has_dropout
from hydra_ensembles.precision import resolve_precision
from hydra_ensembles.scoring import (
    CircuitConfig,
    CircuitOrder,
    extract_circuit,
    taylor_head_set,
    taylor_scores,
)
from hydra_ensembles.scoring.taylor import DECIDING_PRECISION
from hydra_ensembles.surgery import prune
from hydra_ensembles.training import FineTuneConfig, fine_tune

from .cache import Cache, Stage
from .config import DemoConfig
from .data import load_demo_task, model_key, prepare_benchmark
from .recipes import (
    batch_ensemble_settings,
    head_ensemble_settings,
    lora_settings,
    mimo_settings,
    packed_settings,
    train_batch_ensemble,
    train_heads,
    train_lora,
    train_mimo_model,
    train_model,
    train_packed,
)
from .state import Baselines, DemoRun, Method, PrunedModels, Rankings


def start_run(config: DemoConfig, cache: Cache | None = None) -> DemoRun:
    """Resolve the precisions, load the data and make its batches; models and rankings go to
    ``cache`` (default: ``Cache(config.cache_dir, config.use_cache)``)."""
    stage = Stage()
    torch.manual_seed(config.seed)
    compute = resolve_precision(config.precision)
    evaluation = resolve_precision(config.eval_precision or compute)
    # the resolved name, not "auto", goes into every cache key: a cache made in bf16 on one
    # machine is not reused as if it were fp32 on another
    config = replace(config, precision=compute.name, recipe=replace(config.recipe, precision=compute.name))
    print(f"precision: {compute}" + (f"; evaluation in {evaluation.name}" if evaluation != compute else ""))
    task = stage.run("load data", lambda: load_demo_task(config))
    for note in config.scaled_down():
        print(f"  scaled down: {note}")
    bench = stage.run("prepare batches", lambda: prepare_benchmark(config, task))
    # each cached artefact is keyed by the data, the starting model and its own training settings
    # (so that, e.g., a new LoRA learning rate retrains the LoRA members and nothing else)
    cache = cache if cache is not None else Cache(config.cache_dir, config.use_cache)
    return DemoRun(config, task, bench, cache, stage, compute, evaluation)


def trained_single(run: DemoRun, seed: int) -> torch.nn.Module:
    """The Single model of ``seed`` (fine-tuned, or trained from scratch), cached."""
    bench, settings = run.bench, run.config.recipe.config(run.config.model_seed(seed))
    verb = "train from scratch" if bench.from_scratch else "fine-tune"
    return run.cached_model(
        f"{verb}: model (seed {seed})",
        "finetuned",
        model_key(bench, settings),
        partial(train_model, bench, settings),
    )


def pruned_member(
    run: DemoRun,
    base: torch.nn.Module,
    name: str,
    heads: HeadSet,
    seed: int,
    trunk: int = 0,
    mlp_keep: float = 1.0,
) -> torch.nn.Module:
    """``base`` pruned to ``heads`` (and ``mlp_keep`` of its MLP neurons) and fine-tuned with the
    members' settings of ``seed`` (with ``trunk``: only the blocks after the first ``trunk``),
    cached."""
    settings = run.config.recipe.config(run.config.model_seed(seed), member=True)
    if trunk:  # the shared trunk stays as in the base: train only the later blocks
        settings = replace(settings, last_k_blocks=base.config.num_hidden_layers - trunk)
    # no key change for the usual members
    extra = {"bootstrap": True} if run.config.bagging else {}
    if mlp_keep != 1:
        extra["mlp_keep"] = mlp_keep
    key = model_key(run.bench, settings, base=run.base_settings, heads=heads.to_dict(), trunk=trunk, **extra)
    train = partial(prune_and_fine_tune, run, base, heads, settings, run.config.bagging, mlp_keep)
    return run.cached_model(f"fine-tune {name}", "member", key, train)


def train_baselines(run: DemoRun) -> Baselines:
    """Single models (seeds 0..M-1), LoRA members, and optionally a BatchEnsemble."""
    config, bench = run.config, run.bench
    singles = [trained_single(run, s) for s in range(config.members)]
    start = run.base_settings if bench.from_scratch else "pretrained"
    loras = [
        run.cached_model(
            f"LoRA fine-tune (seed {s})",
            "lora",
            model_key(
                bench,
                lora_settings(bench, config.recipe, config.model_seed(s)),
                rank=config.lora_rank,
                start=start,
            ),
            partial(train_lora, bench, config.recipe, singles[0], config.model_seed(s), config.lora_rank),
        )
        for s in range(config.members)
    ]
    one_model = {}
    if config.batch_ensemble:
        name = f"BatchEnsemble (M={config.members})"
        key = model_key(
            bench,
            batch_ensemble_settings(bench, config.recipe),
            members=config.members,
            init_std=config.batch_ensemble_init_std,
            start=start,
        )
        build = partial(
            train_batch_ensemble,
            bench,
            config.recipe,
            singles[0],
            config.members,
            config.batch_ensemble_init_std,
        )
        one_model[name] = run.cached_model(f"fine-tune: {name}", "batch-ensemble", key, build)
    one_model.update(packed_and_mimo(run, singles[0]))
    settings = head_ensemble_settings(config.recipe)
    heads = run.cached_model(
        f"train {config.members} heads on Single's backbone (Deep Ensemble (D))",
        "head-ensemble",
        model_key(bench, settings, base=run.base_settings, members=config.members),
        partial(train_heads, bench, settings, singles[0], config.members),
    )
    return Baselines(singles, loras, one_model, heads)


def packed_and_mimo(run: DemoRun, base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The opt-in Packed-Ensembles and MIMO baselines, by method name."""
    config, bench, members = run.config, run.bench, run.config.members
    models = {}
    packings = [(2, False)] if bench.from_scratch else [(2, False), (members, True)]
    for alpha, pretrained in packings if config.packed else []:
        start = "pretrained" if pretrained else "scratch"
        name = f"Packed-Ensembles (M={members}, α={alpha}, from {start})"
        settings = packed_settings(bench, config.recipe, pretrained)
        key = model_key(bench, settings, members=members, alpha=alpha, start=start)
        build = partial(train_packed, bench, settings, members, alpha, pretrained)
        models[name] = run.cached_model(f"train {name}", "packed", key, build)
    if config.mimo:
        name = f"MIMO (M={members}, ρ={config.mimo_rho}, batch repeat {config.mimo_batch_repeat})"
        key = model_key(
            bench,
            mimo_settings(bench, config.recipe),
            members=members,
            rho=config.mimo_rho,
            repeat=config.mimo_batch_repeat,
            start=run.base_settings if bench.from_scratch else "pretrained",
        )
        build = partial(
            train_mimo_model, bench, config.recipe, base, members, config.mimo_rho, config.mimo_batch_repeat
        )
        models[name] = run.cached_model(f"train {name}", "mimo", key, build)
    return models


def rank_heads(run: DemoRun, base: torch.nn.Module) -> Rankings:
    """Taylor scores, Taylor's one-shot head set, and the CircAvg circuit (resumable)."""
    config = run.config
    key = {**run.bench.key, "base": run.base_settings, "precision": run.compute.name}
    return rank_model(run, base, run.calibration, config.heads_per_layer, key)


def rank_model(
    run: DemoRun,
    model: torch.nn.Module,
    calib: list[dict],
    keep: int,
    key: dict[str, Any],
    kind: str = "",
    label: str = "",
) -> Rankings:
    """Taylor scores on ``calib``, Taylor's per-layer head set keeping ``keep`` heads, and the
    CircAvg circuit on the benchmark's circuit data (resumable), each cached under ``key``.
    ``kind`` prefixes the cache kinds and ``label`` names the stages (for several models)."""
    config, compute = run.config, run.compute.name
    named = f", {label}" if label else ""
    scores = run.cached_json(
        f"Taylor scores{f' ({label})' if label else ''}",
        f"{kind}taylor-scores",
        key,
        lambda: taylor_scores(model, calib, precision=DECIDING_PRECISION).tolist(),  # members' ranking
    )
    single = run.cached_json(
        f"Taylor pruning (prune -> recompute{named})",
        f"{kind}taylor-heads",
        {**key, "keep": keep},
        lambda: taylor_head_set(model, calib, keep).to_dict(),
    )
    circuit_key = {
        **key,
        "recipe": config.circuit_budget,
        "id": config.circuit_id_items,
        "ood": config.circuit_ood_items,
        "objective": "avg",
        "length": config.circuit_length,
    }
    checkpoint = run.cache.path(f"{kind}circuit-progress", circuit_key) / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if not config.use_cache:
        checkpoint.unlink(missing_ok=True)
    order = run.cached_json(
        f"circuit extraction (CircAvg{named})",
        f"{kind}circuit",
        circuit_key,
        lambda: extract_circuit(
            model,
            run.bench.circuit_id,
            run.bench.circuit_ood,
            CircuitConfig(objective="avg", budget=config.circuit_budget, precision=compute),
            checkpoint=checkpoint,
        ).to_dict(),
    )
    return Rankings(torch.tensor(scores), HeadSet.from_dict(single), CircuitOrder.from_dict(order))


def build_pruned(run: DemoRun, base: torch.nn.Module, rankings: Rankings) -> PrunedModels:
    """Single pruned models, members sampled from each ranking (fine-tuned), fused Hydras, and
    with ``trunk_study`` Hydra (Circ) with a shared trunk of L/3 and L/2 layers."""
    config = run.config
    layers = base.config.num_hidden_layers
    member = partial(pruned_member, run, base)

    def hydra(ranking, kind: str, trunk: int = 0) -> Build:
        """Members pruned from ``ranking`` and fine-tuned (cached), fused: `build.build_hydra`."""
        settings = BuildConfig(
            num_members=config.members,
            num_pruned=config.num_pruned,
            pool_size=config.pool_size,
            seed=config.seed,
            shared_layers=trunk,
            mlp="merge",
            keep_base=config.keep_base and not trunk,
        )
        suffix = f" (trunk {trunk})" if trunk else ""

        def make(m: int, hs: HeadSet) -> torch.nn.Module:
            if m == 0 and settings.keep_base:  # the base itself, as build_hydra makes it
                return prune(base, hs)
            return member(f"{kind} member {m}{suffix}", hs, m, trunk, config.mlp_keep)

        return build_hydra(base, config=settings, ranking=ranking, make_member=make)

    singles = {
        "Taylor": member("Taylor (single pruned)", rankings.taylor_single, 0),
        "CircAvg": member("CircAvg (single pruned)", rankings.circuit.head_set(config.num_pruned), 0),
    }
    for name in UNSTRUCTURED:
        if getattr(config, name.lower()):
            singles[name] = unstructured_member(run, base, singles["Taylor"], name)
    built = {"taylor": hydra(rankings.taylor, "taylor"), "circ": hydra(rankings.circuit, "circ")}
    member_heads = {kind: b.head_sets for kind, b in built.items()}
    hydras = {"Hydra (Taylor)": built["taylor"].hydra.eval(), "Hydra (Circ)": built["circ"].hydra.eval()}
    trunks = {}
    for trunk in sorted({layers // 3, layers // 2}) if config.trunk_study else []:
        trunks[f"Hydra (Circ, shared trunk {trunk}/{layers})"] = hydra(
            rankings.circuit, "circ", trunk
        ).hydra.eval()
    return PrunedModels(singles, member_heads, hydras, trunks)


UNSTRUCTURED = ("OBA", "Wanda")
"""The unstructured baselines, in table order; each has a `DemoConfig` flag of its name."""


def unstructured_member(
    run: DemoRun, base: torch.nn.Module, matched: torch.nn.Module, name: str
) -> torch.nn.Module:
    """``name``'s unstructured pruning of as many parameters as ``matched`` lost (calibrated on the
    Taylor calibration batches), fine-tuned with the members' settings, its zeros kept."""
    settings = run.config.recipe.config(0, member=True)
    sparsity = matched_sparsity(base, matched)
    method = name.lower()

    def build() -> torch.nn.Module:
        model = unstructured_prune(base, run.calibration, sparsity, method)
        fine_tune(model, run.bench.train, None, settings, progress=True)
        return make_permanent(model)

    key = model_key(run.bench, settings, base=run.base_settings, **{method: round(sparsity, 6)})
    label = f"{name} ({sparsity:.1%} of layer weights) + fine-tune"
    return run.cached_model(label, method, key, build)


def unstructured_meta(base: torch.nn.Module, pruned: PrunedModels) -> dict[str, str]:
    """What the unstructured rows prune, where there are any."""
    names = [name for name in UNSTRUCTURED if name in pruned.singles]
    if not names:
        return {}
    matched = pruned.singles["Taylor"]
    removed = count_parameters(base) - count_parameters(matched)
    return {
        "unstructured pruning": f"{', '.join(names)}: {matched_sparsity(base, matched):.1%} of the "
        f"attention and MLP weights zeroed, as many parameters as the Taylor single pruned model "
        f"removes ({removed:,} of {count_parameters(base):,}); run dense, so they cost what Single costs"
    }


def prune_and_fine_tune(
    run: DemoRun,
    base: torch.nn.Module,
    heads: HeadSet,
    settings: FineTuneConfig,
    bootstrap: bool = False,
    mlp_keep: float = 1.0,
) -> torch.nn.Module:
    """``base`` pruned to ``heads`` (and to ``mlp_keep`` of its MLP neurons, as `build_hydra`
    does), fine-tuned on the run's training batches (with ``bootstrap``: on their bootstrap
    resample of the settings' seed, as `build_hydra` does) (uncached)."""
    member = prune(base if mlp_keep == 1 else narrow_mlp(base, mlp_keep), heads)
    train = run.bench.train
    if bootstrap:
        train = bootstrap_batches(list(train), settings.seed, pad_id(base))
    fine_tune(member, train, None, settings, progress=True)
    return member


def fused_ensembles(baselines: Baselines, heads: str) -> list[Method]:
    """The deep ensemble and the LoRA-Ensemble, each fused into one model (exact per-member parts;
    what LoRA members share runs as one module), compared with Single on the same resamples."""
    members = len(baselines.singles)
    return [
        Method(
            f"{family} (M={members})",
            fuse(models, mlp="exact").eval(),
            heads,
            cost_name=family,
            reliability=family == "Deep Ensemble",
            compare_with=("Single",),
        )
        for family, models in (("Deep Ensemble", baselines.singles), ("LoRA-Ensemble", baselines.loras))
    ]


def table_methods(run: DemoRun, baselines: Baselines, pruned: PrunedModels) -> list[Method]:
    """Every method of the table, in its order: adding a method is one record here."""
    config, base = run.config, baselines.singles[0]
    full_heads, layers = base.config.num_attention_heads, base.config.num_hidden_layers
    full = f"{full_heads}/{full_heads}"
    pruned_avg = f"avg {(full_heads * layers - config.num_pruned) / layers:.0f}/{full_heads}"
    deep = f"Deep Ensemble (M={config.members})"
    methods = [
        Method("Single", base, full, calibrate=True, cost_name="Single", reliability=True),
        Method(
            f"Deep Ensemble (D, M={config.members})",
            baselines.head_ensemble,
            full,
            cost_name="Deep Ensemble (D)",
        ),
        *([Method("MC Dropout", base, full, mc_samples=config.mc_samples)] if has_dropout(base) else []),
        *fused_ensembles(baselines, full),
        *(Method(n, m, full, cost_name=n) for n, m in baselines.one_model.items()),
        Method("Taylor (single pruned)", pruned.singles["Taylor"], f"{config.heads_per_layer}/{full_heads}"),
        Method("CircAvg (single pruned)", pruned.singles["CircAvg"], pruned_avg),
        *(
            Method(f"{name} (unstructured, single pruned)", pruned.singles[name], full)
            for name in UNSTRUCTURED
            if name in pruned.singles
        ),
        Method("Hydra (Taylor)", pruned.hydras["Hydra (Taylor)"], pruned_avg),
    ]
    circ = pruned.hydras["Hydra (Circ)"]
    methods.append(
        Method(
            "Hydra (Circ)",
            circ,
            pruned_avg,
            calibrate=True,
            cost_name="Hydra (Circ)",
            reliability=True,
            detail=True,
            compare_with=("Single", deep),
        )
    )
    if run.evaluation.reduced:  # how much does reduced precision move Hydra's numbers?
        methods.append(Method("Hydra (Circ), fp32 evaluation", circ, pruned_avg, precision="fp32"))
    methods += [
        Method(name, hydra, pruned_avg, cost_name=name, compare_with=("Single",))
        for name, hydra in pruned.trunks.items()
    ]
    return methods
