"""`extract_circuit`, the entry point, and `CircuitConfig`, every setting of one extraction."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torch import nn

from ...adapters import get_adapter
from ...hashing import batches_digest, fingerprint, json_digest
from ...heads import HeadSet
from ...inputs import checked_batches
from ...precision import Precision, in_precision, model_device, resolve_precision
from ...saving.formats import check_finite
from ...surgery import kept_heads
from .candidates import (
    CandidateMasks,
    SuffixCache,
    last_layers,
)
from .order import OBJECTIVES, CircuitError, CircuitOrder, Objective
from .rescoring import ExactRescoring
from .search import Extraction


@dataclass(frozen=True)
class CircuitConfig:
    """Every setting of a circuit extraction (`extract_circuit`), which `build.BuildConfig` and
    the command line pass through whole.

    ``objective``: what a removal keeps (``acc``, ``ood`` or their average ``avg``); ``budget``:
    heads to remove; ``min_heads_per_layer``: heads every layer keeps; ``method``: ``fast``
    (exact, with the suffix cache), ``reference`` (exact, plain) or ``lazy`` (approximate: only
    ``shortlist`` candidates per step between full evaluations every ``refresh_every`` steps);
    ``candidate_chunk``: candidates evaluated per stacked pass; ``cache_gb``: the memory of the
    fast path's cross-step reuse (0 turns it off; results are the same either way);
    ``precision`` and ``rescore``: see `extract_circuit`."""

    objective: Objective = "avg"
    budget: int = 24
    min_heads_per_layer: int = 0
    method: Literal["fast", "reference", "lazy"] = "fast"
    candidate_chunk: int = 16
    shortlist: int = 8
    refresh_every: int = 8
    cache_gb: float = 2.0
    precision: str = "auto"
    rescore: bool = True


def extract_circuit(
    model: nn.Module,
    id_val: Iterable[dict[str, Any]],
    ood_val: Iterable[dict[str, Any]] | None = None,
    config: CircuitConfig | None = None,
    *,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    **settings: Any,
) -> CircuitOrder:
    """Greedy circuit extraction: remove ``budget`` heads, one per step, best-S first.

    ``id_val`` and ``ood_val`` are iterables of model-input batches (``id_val`` with ``labels``);
    ``ood_val`` is a *validation* OOD set, never a test set. ``min_heads_per_layer`` keeps at least
    that many heads in every layer. ``checkpoint`` (a JSON path) makes the run resumable.
    ``method="lazy"`` (approximate) evaluates only ``shortlist`` candidates per step between full
    evaluations every ``refresh_every`` steps. ``cache_gb`` caps the memory of the fast path's
    cross-step reuse (hidden states per candidate; 0 turns it off; results are the same either way).
    ``precision``: candidates are scored on a copy of the model cast to it where the model's
    dtype differs (`precision.resolve_precision`; ``auto`` is bf16 only where it is native). In
    bf16 or fp16, every candidate that could be the best once rounding is accounted for
    (`objective_bounds`, with twice the largest logit error seen between the two precisions) is
    scored again in fp32, and the choice is made on the fp32 scores: the order is fp32's
    (`ExactRescoring`). Once a step has scored most of its candidates twice, the later steps are
    scored in fp32 alone (the same order; what that saves: `rescoring.MOST`). fp32 gives the same
    order on every path (fast, reference).
    ``rescore=False`` skips that: the low-precision order, faster, but near-ties are decided by
    the machine's rounding (`benchmarks/circuit_speed.py --precisions` measures both).
    ``config`` (`CircuitConfig`) holds the settings; keyword ``settings`` replace single fields
    of it (``extract_circuit(model, val, ood, budget=12)``).
    """
    config = _circuit_config(config, settings)
    adapter = get_adapter(model)
    heads = adapter.original_heads_per_layer(model)
    id_batches, ood_batches = _checked_inputs(model, heads, id_val, ood_val, config.objective)
    _check_budget(heads, config.budget, config.min_heads_per_layer)
    run, key = _extraction(model, adapter, heads, id_batches, ood_batches, config)
    was_training = run.model.training
    run.model.eval()
    try:
        order = run.extract(config.budget, checkpoint, key, progress)
    finally:
        run.masks.remove()
        if run.exact is not None:
            run.exact.close()
        run.model.train(was_training)
    order.removed, order.scores = order.removed[: config.budget], order.scores[: config.budget]
    return order


def _circuit_config(config: CircuitConfig | None, settings: dict[str, Any]) -> CircuitConfig:
    """``config`` (default `CircuitConfig()`) with keyword ``settings`` replacing its fields."""
    if config is not None and not isinstance(config, CircuitConfig):
        raise TypeError(f"config must be a CircuitConfig (settings by keyword), got {config!r:.40}")
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(CircuitConfig)})
    if unknown:
        raise TypeError(f"extract_circuit has no setting {unknown[0]!r}")
    return dataclasses.replace(config or CircuitConfig(), **settings)


def _extraction(
    model, adapter, heads, id_batches, ood_batches, config: CircuitConfig
) -> tuple[Extraction, str]:
    """The greedy search over ``model`` in its computing precision (with an fp32 copy for exact
    re-scoring in a reduced one), and the key of its checkpoints."""
    lazy = _lazy_settings(config.objective, config.method, config.shortlist, config.refresh_every)
    compute = resolve_precision(config.precision, model_device(model))
    rescore = config.rescore and compute.reduced
    exact_model = in_precision(model, Precision("fp32", "exact re-scoring")) if rescore else None
    model = in_precision(model, compute)
    name = f"{compute.name}, fp32 re-scoring" if rescore else compute.name
    settings = [name, config.objective, config.min_heads_per_layer, *([lazy] if lazy else [])]
    key = _run_key(model, settings, id_batches, ood_batches)  # exact methods share checkpoints
    masks = CandidateMasks(model)
    limit = config.cache_gb * 2**30
    exact = None
    if exact_model is not None:
        exact_cache = SuffixCache(last_layers(adapter), limit)
        exact = ExactRescoring(
            exact_model, adapter, masks, config.method, config.candidate_chunk, exact_cache
        )
    run = Extraction(
        model=model,
        adapter=adapter,
        masks=masks,
        original_heads_per_layer=heads,
        id_batches=id_batches,
        ood_batches=ood_batches,
        objective=config.objective,
        min_heads_per_layer=config.min_heads_per_layer,
        method=config.method,
        chunk=config.candidate_chunk,
        lazy=lazy,
        cache=None if config.method == "reference" else SuffixCache(last_layers(adapter), limit),
        exact=exact,
    )
    return run, key


def _lazy_settings(objective: str, method: str, shortlist: int, refresh_every: int) -> dict[str, Any] | None:
    """The lazy method's settings (part of the checkpoint key), None for the exact methods."""
    if objective not in OBJECTIVES:
        raise CircuitError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if method not in ("fast", "reference", "lazy"):
        raise CircuitError(f"method must be 'fast', 'reference' or 'lazy', got {method!r}")
    if method != "lazy":
        return None
    if shortlist < 1 or refresh_every < 1:
        raise CircuitError("lazy extraction needs shortlist >= 1 and refresh_every >= 1")
    return {"method": "lazy", "shortlist": shortlist, "refresh_every": refresh_every}


def _checked_inputs(
    model, original_heads_per_layer, id_val, ood_val, objective
) -> tuple[list[dict], list[dict]]:
    """ID batches (labelled within the model's classes) and OOD batches, for an unpruned model."""
    if kept_heads(model).resolve(original_heads_per_layer) != HeadSet.full(original_heads_per_layer).resolve(
        original_heads_per_layer
    ):
        raise CircuitError("extract circuits from an unpruned model; prune with the resulting head sets")
    check_finite(model.named_parameters(), "the model", CircuitError)
    id_batches = checked_batches(
        id_val or [], "id_val", int(model.config.num_labels), CircuitError, model=model
    )
    ood_batches = (
        [] if ood_val is None else checked_batches(ood_val, "ood_val", error=CircuitError, model=model)
    )
    if objective in ("ood", "avg") and not ood_batches:
        raise CircuitError(f"objective {objective!r} needs OOD validation data (ood_val)")
    return id_batches, ood_batches


def _check_budget(original_heads_per_layer: list[int], budget: int, min_heads_per_layer: int) -> None:
    total, fewest = sum(original_heads_per_layer), min(original_heads_per_layer)
    if min_heads_per_layer < 0 or min_heads_per_layer > fewest:
        raise CircuitError(
            f"min_heads_per_layer={min_heads_per_layer} is impossible: layers have {fewest} heads"
        )
    removable = total - sum(min(min_heads_per_layer, h) for h in original_heads_per_layer)
    if not 0 <= budget <= removable:
        raise CircuitError(
            f"budget {budget} out of range: at most {removable} of {total} heads can be removed"
            + (f" with min_heads_per_layer={min_heads_per_layer}" if min_heads_per_layer else "")
        )


def _run_key(model: nn.Module, settings: list, id_batches: list[dict], ood_batches: list[dict]) -> str:
    """What a checkpoint must match to be resumed: the model, settings and data."""
    return json_digest(
        [
            fingerprint(model),
            *settings[:3],
            batches_digest(id_batches),
            batches_digest(ood_batches),
            *settings[3:],
        ]
    )
