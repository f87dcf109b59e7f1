"""What the demo's stages pass to each other: the run, the trained baselines, the rankings, the
pruned models, the methods of the table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hydra_ensembles.heads import HeadSet
from hydra_ensembles.precision import Precision
from hydra_ensembles.scoring import CircuitOrder

from .cache import Cache, Stage
from .config import DemoConfig
from .data import Benchmark
from .tasks import Task


@dataclass
class Method:
    """One method of the demo: its model and how it is predicted, calibrated and reported.
    Its result rows follow the order of the method list; temperature-scaled rows follow it."""

    name: str
    model: Any
    """A model, a list of models (an explicit ensemble), or a fused `HydraModel`."""
    heads: str
    """The table's Heads column (e.g. ``12/12`` or ``avg 10/12``)."""
    mc_samples: int = 0
    calibrate: bool = False
    """Also report temperature scaling fit on the ID validation split."""
    cost_name: str | None = None
    """Its name in the cost table (None: not timed)."""
    reliability: bool = False
    """Drawn in the reliability diagram."""
    detail: bool = False
    """Confidence histograms and ROC curves of its own."""
    precision: str | None = None
    """Evaluation precision (None: the run's)."""
    compare_with: tuple[str, ...] = ()
    """Methods its rows are compared with, paired on the same bootstrap resamples (row by row:
    ``+ TS`` with ``+ TS`` where both exist)."""


@dataclass
class DemoRun:
    """What every stage of a demo run shares."""

    config: DemoConfig
    task: Task
    bench: Benchmark
    cache: Cache
    stage: Stage
    compute: Precision
    evaluation: Precision

    @property
    def base_settings(self) -> dict[str, Any]:
        return asdict(self.config.recipe.config(self.config.model_seed(0)))

    @property
    def calibration(self) -> list[dict]:
        """The first 64 training items: what Taylor scores and the unstructured baselines calibrate on."""
        return self.bench.train[: max(1, 64 // self.config.recipe.batch_size)]

    def cached_model(self, label: str, kind: str, key: dict[str, Any], build: Callable[[], Any]) -> Any:
        return self.stage.run(label, lambda: self.cache.model(kind, key, build))

    def cached_json(self, label: str, kind: str, key: dict[str, Any], build: Callable[[], Any]) -> Any:
        return self.stage.run(label, lambda: self.cache.json(kind, key, build))


@dataclass
class Baselines:
    singles: list[torch.nn.Module]
    """Single models of seeds 0..M-1: the first is "Single", all of them the deep ensemble."""
    loras: list[torch.nn.Module]
    one_model: dict[str, torch.nn.Module]
    """Ensembles in one model, opt-in: BatchEnsemble, Packed-Ensembles, MIMO (by method name)."""
    head_ensemble: torch.nn.Module
    """Deep Ensembles (D): Single's backbone with M task heads trained from seeds 0..M-1."""


@dataclass
class Rankings:
    taylor: torch.Tensor
    taylor_single: HeadSet
    circuit: CircuitOrder


@dataclass
class PrunedModels:
    singles: dict[str, torch.nn.Module]
    """"Taylor" and "CircAvg": one pruned model each."""
    member_heads: dict[str, list[HeadSet]]
    hydras: dict[str, Any]
    """Fused Hydra models by method name: Hydra (Taylor) and Hydra (Circ)."""
    trunks: dict[str, Any] = field(default_factory=dict)
    """Hydra (Circ) with a shared trunk, by method name (``trunk_study``)."""


@dataclass
class PruningCurves:
    """Training-free pruning of the base model along each ranking (the paper's Figure 5) and the
    rows at the heads each member prunes, in the paper's Table 4 layout."""

    curves: dict[str, dict[str, list]]
    """``curves[metric][method]``: (heads pruned, value) pairs; accuracy, ECE, AUROC, FPR95."""
    num_pruned: int
    """The heads each member prunes, where the Table 4 rows are taken."""
    results: dict[str, Any]
    """The Table 4 rows' results (`evaluate_predictions`, MSP): Single (nothing pruned), then each
    ranking at ``num_pruned``, with ``DemoConfig.bootstrap`` intervals and each pruned row's
    paired difference from Single."""
