"""The paper's experiment on an embedded benchmark, end to end (``hydra-ens demo``).

Text (default): MiniLM-L6 fine-tuned on BBC News; image: a small ViT trained from scratch on
Fashion-MNIST (``tasks`` describes the data). Fine-tune (or train) the base -> Taylor scores and
circuit extraction -> members -> fine-tune members -> fuse -> evaluate every method (Single,
temperature scaling, MC dropout, Deep Ensembles, LoRA-Ensemble, single pruned models, Hydra) ->
cost benchmark -> report.

Every method gets the same training budget: the same training data, epochs, learning rate,
schedule, batch size and token length (`TrainingBudget`), with no early stopping (so no
per-epoch validation pass either: the validation split serves temperature scaling and
selection scripts only); members start from the fine-tuned base
(as in the paper's post-pruning fine-tuning), the other methods from the pretrained model. With
no pretrained ViT offline, the image task trains Single and every Deep-Ensemble member from
scratch (seeds 0..M-1), and LoRA-Ensemble members adapt the trained Single model (seeds 0..M-1)
for as many epochs as pruned members get.
Expensive artefacts (fine-tuned models, rankings) are cached under ``cache_dir``, keyed by a hash
of everything they depend on, so a second run is fast.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import reporting
from .batching import model_inputs
from .cost import count_parameters, interleaved_latency, median, multiply_adds
from .data import to_batches as data_batches
from .evaluation import Predictions, evaluate_predictions, fit_temperature, predict
from .evaluation.evaluate import ood_scores
from .fusion import fuse
from .heads import HeadSet
from .io import atomic_write_json
from .members import FineTuneConfig, load_member, member_overlap, sample_members, save_member
from .members.batch_ensemble import batch_ensemble
from .members.finetune import fine_tune
from .members.lora import lora_fine_tune
from .members.sampling import least_useful_first
from .metrics import classification
from .models import DEFAULT_IMAGE_MODEL, DEFAULT_TEXT_MODEL, load_classifier, load_tokenizer, small_vit
from .precision import Precision, in_precision, resolve_precision
from .runtime import describe_machine
from .scoring import CircuitOrder, extract_circuit, removal_ranking, taylor_head_set, taylor_scores
from .surgery import prune
from .tasks import Dataset, Task, load_image_task, load_text_task


@dataclass(frozen=True)
class TrainingBudget:
    """The one training recipe every method uses (written into the report)."""

    epochs: int = 2
    member_epochs: int = 1
    lr: float = 3e-4
    lora_lr_scale: float = 20.0
    """LoRA adapters train with this multiple of ``lr`` (adapters need larger steps; 6e-3 beat
    1e-3 and 3e-3 on the ID validation split of the text task)."""
    batch_size: int = 16
    warmup: float = 0.1
    weight_decay: float = 0.01
    label_smoothing: float = 0.0
    precision: str = "auto"
    trainable: tuple[str, ...] = ("attention", "mlp", "norm", "head")
    """The paper's fine-tuned parts (D.2); the word embeddings stay frozen, which also saves a
    third of every training step (their dense gradient and optimizer state are half of MiniLM's
    parameters). Training from scratch (the image task) trains the embeddings too."""

    def config(self, seed: int, member: bool = False, lora: bool = False) -> FineTuneConfig:
        return FineTuneConfig(
            epochs=self.member_epochs if member else self.epochs,
            lr=self.lr * (self.lora_lr_scale if lora else 1.0),
            warmup=self.warmup,
            weight_decay=self.weight_decay,
            label_smoothing=self.label_smoothing,
            precision=self.precision,
            seed=seed,
            trainable=self.trainable,
        )


IMAGE_BUDGET = TrainingBudget(
    epochs=5,
    member_epochs=2,
    lr=1e-3,
    lora_lr_scale=1.0,
    batch_size=64,
    weight_decay=0.05,
    trainable=("attention", "mlp", "norm", "head", "embeddings"),
)
"""Training from scratch needs more epochs and a larger step than fine-tuning. LoRA adapters on
the trained image model use the same learning rate: on the ID validation split, 1x / 3x / 10x
gave NLL 0.496 / 0.497 / 0.516 (``python benchmarks/lora_lr.py --task image``)."""


@dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on; ``DemoConfig.preset(task, full)`` gives the defaults.

    ``max_length`` and ``circuit_length`` (tokens) apply to text only; "items" are texts or images.
    """

    task: str = "text"
    model: str = DEFAULT_TEXT_MODEL
    full: bool = False
    max_length: int = 24
    train_limit: int | None = 256
    val_limit: int | None = 200
    test_limit: int | None = None
    ood_limit: int | None = 60
    shift_limit: int | None = 10
    members: int = 3
    heads_per_layer: int = 8
    pruned_per_member: int = 24
    pool_size: int = 48
    circuit_budget: int = 48
    circuit_id_items: int = 10
    circuit_ood_items: int = 10
    circuit_length: int = 16
    curve_step: int = 16
    """The zero-shot pruning curves measure every ``curve_step`` heads up to the pool size."""
    precision: str = "auto"
    """Compute precision of training, head scoring, circuit extraction, evaluation and the cost
    table: ``auto`` (bf16 only where this machine computes it natively and faster, else fp32;
    `precision.resolve_precision`), ``fp32``, ``bf16`` or ``fp16``."""
    eval_precision: str | None = None
    """Evaluation's own precision (``None``: ``precision``); ``--full`` evaluates in fp32."""
    mc_samples: int = 4
    lora_rank: int = 8
    budget: TrainingBudget = field(default_factory=TrainingBudget)
    eval_batch_size: int = 64
    seed: int = 0
    cache_dir: Path = Path("runs/cache")
    out_dir: Path = Path("runs/demo")
    use_cache: bool = True
    bench_repeats: int = 5
    trunk_study: bool = False
    """Also build Hydra (Circ) with a shared trunk of L/3 and L/2 layers (members diverse and
    fine-tuned only after it) and report its quality and cost beside full Hydra."""
    batch_ensemble: bool = False
    """Also report a BatchEnsemble of M members (the paper's baseline), converted from the
    pretrained model (text) or the trained Single model (image) and fine-tuned."""
    batch_ensemble_init_std: float = 0.1
    """Spread of BatchEnsemble's rank-1 factors around 1, chosen on ID validation NLL among
    0.05 / 0.1 / 0.5 (``python benchmarks/batch_ensemble_std.py --task text|image``): 0.1 for
    text (val NLL 0.181 / 0.176 / 0.954), 0.05 for images (0.456 / 0.465 / 0.475)."""

    @classmethod
    def preset(cls, task: str = "text", full: bool = False, **overrides) -> DemoConfig:
        """The default (about 5 minutes for text here) or ``full`` protocol of a task.

        Text full: every training text, 96 tokens, 3 epochs, circuit extraction on 48 + 48 texts
        of 64 tokens, fp32 evaluation of every test text. Image default: 6,000 training images,
        5 epochs from scratch; image full: 30,000 training images (of about 43,000; all of them did not
        fit an hour here), 3 epochs, all 8,000 ID test images, circuit extraction on 256 + 256
        images, fp32 evaluation.
        """
        if task == "text":
            base = cls()
            if full:
                base = replace(
                    base,
                    max_length=96,
                    train_limit=None,
                    val_limit=None,
                    ood_limit=None,
                    shift_limit=100,
                    circuit_id_items=48,
                    circuit_ood_items=48,
                    circuit_length=64,
                    curve_step=8,
                    eval_precision="fp32",
                    mc_samples=8,
                    budget=TrainingBudget(epochs=3, member_epochs=1),
                )
        elif task == "image":
            base = cls(
                task="image",
                model=DEFAULT_IMAGE_MODEL,
                out_dir=Path("runs/demo-image"),
                train_limit=6000,
                val_limit=1000,
                test_limit=2000,
                ood_limit=500,
                shift_limit=200,
                circuit_id_items=64,
                circuit_ood_items=64,
                budget=IMAGE_BUDGET,
                batch_ensemble_init_std=0.05,
            )
            if full:
                base = replace(
                    base,
                    train_limit=30000,
                    val_limit=None,
                    test_limit=None,
                    ood_limit=1000,
                    shift_limit=500,
                    circuit_id_items=256,
                    circuit_ood_items=256,
                    eval_precision="fp32",
                    mc_samples=8,
                    budget=replace(IMAGE_BUDGET, epochs=3, member_epochs=1),
                )
        else:
            raise ValueError(f"unknown task {task!r}; choose 'text' or 'image'")
        return replace(base, full=full, **overrides)

    @property
    def command(self) -> str:
        return (
            "hydra-ens demo"
            + (f" --task {self.task}" if self.task != "text" else "")
            + (" --full" if self.full else "")
        )

    def scaled_down(self) -> list[str]:
        """What this configuration shrinks relative to the paper's protocol, in words."""
        text = self.task == "text"
        items = "texts" if text else "images"
        start = "fine-tuned" if text else "trained from scratch"
        notes = [f"texts truncated to {self.max_length} tokens"] if text else []
        notes += [
            f"base and deep-ensemble members {start} {self.budget.epochs} epoch(s); pruned members "
            f"fine-tuned {self.budget.member_epochs} epoch(s) from the base",
            f"circuit extraction on {self.circuit_id_items} ID + {self.circuit_ood_items} OOD validation "
            f"{items}" + (f" of {self.circuit_length} tokens" if text else ""),
        ]
        if self.train_limit:
            notes.append(f"training on {self.train_limit} of the training {items}")
        if self.val_limit:
            notes.append(f"temperatures fit on {self.val_limit} ID validation {items}")
        if self.test_limit:
            notes.append(f"testing on {self.test_limit} of the ID test {items}")
        if self.ood_limit:
            notes.append(f"at most {self.ood_limit} {items} per OOD test set")
        if self.shift_limit:
            notes.append(f"shift measured on {self.shift_limit} ID test {items}")
        notes.append(f"zero-shot pruning curves every {self.curve_step} heads")
        return notes


@dataclass
class Benchmark:
    """A task as model-input batches, and how its models start (pretrained or from scratch)."""

    task: Task
    train: list[dict]
    val: list[dict]
    test: list[dict]
    oods: dict[str, tuple[str, list[dict]]]
    shifted: dict[tuple[str, int], list[dict]]
    circuit_id: list[dict]
    circuit_ood: list[dict]
    initial: Callable[[int], torch.nn.Module]
    """seed -> the model before training: pretrained weights with a new head, or random."""
    from_scratch: bool
    key: dict[str, Any]
    """What the data and the starting model are (cache keys hash it)."""


def _data_key(dataset: Dataset) -> str:
    return hashlib.sha256("\n".join(dataset.ids).encode()).hexdigest()[:16]


def prepare_benchmark(config: DemoConfig, task: Task) -> Benchmark:
    """Batches for every split, OOD set, shifted set and the circuit-extraction data."""
    classes = len(task.classes)
    from_scratch = config.task == "image"
    tokenizer = None if from_scratch else load_tokenizer(config.model)

    def to_batches(
        data: Dataset, batch_size: int = config.eval_batch_size, length: int = config.max_length
    ) -> list[dict]:  # images ignore the tokenizer and the length
        return list(data_batches(data, tokenizer, batch_size, length))

    def initial(seed: int) -> torch.nn.Module:
        if from_scratch:
            return small_vit(config.model, num_labels=classes, seed=seed)
        return load_classifier(config.model, num_labels=classes, seed=seed)

    def head(data: Dataset, count: int) -> Dataset:
        return data.subset(range(min(count, len(data))))

    return Benchmark(
        task=task,
        train=to_batches(task.train, config.budget.batch_size),
        val=to_batches(task.val),
        test=to_batches(task.test),
        oods={name: (kind, to_batches(data)) for name, (kind, data) in task.ood_test.items()},
        shifted={key: to_batches(data) for key, data in task.shift.items()},
        circuit_id=to_batches(head(task.val, config.circuit_id_items), 64, config.circuit_length),
        circuit_ood=[
            model_inputs(b)
            for b in to_batches(head(task.ood_val, config.circuit_ood_items), 64, config.circuit_length)
        ],
        initial=initial,
        from_scratch=from_scratch,
        key={
            "model": config.model,
            "train": _data_key(task.train),
            "val": _data_key(task.val),
            "length": config.max_length if config.task == "text" else None,
            "classes": classes,
        },
    )


def model_key(bench: Benchmark, settings: FineTuneConfig, **extra) -> dict[str, Any]:
    """Cache key of a model trained on ``bench`` with ``settings`` (plus e.g. heads, start)."""
    return {**bench.key, "settings": asdict(settings), **extra}


def train_model(bench: Benchmark, settings: FineTuneConfig) -> torch.nn.Module:
    """``bench.initial(settings.seed)`` fine-tuned (or trained from scratch) on ``bench``."""
    model = bench.initial(settings.seed)
    fine_tune(model, bench.train, None, settings, progress=True)
    return model


def lora_settings(bench: Benchmark, budget: TrainingBudget, seed: int) -> FineTuneConfig:
    """LoRA members train as long as pruned members where they start from the trained base."""
    return budget.config(seed, member=bench.from_scratch, lora=True)


def train_lora(
    bench: Benchmark, budget: TrainingBudget, base: torch.nn.Module, seed: int, rank: int
) -> torch.nn.Module:
    """A merged LoRA member: adapters on the pretrained model (text) or, with nothing pretrained
    (image), on the trained Single model ``base``."""
    start = base if bench.from_scratch else bench.initial(seed)
    merged, _ = lora_fine_tune(start, bench.train, None, lora_settings(bench, budget, seed), rank=rank)
    return merged


def batch_ensemble_settings(bench: Benchmark, budget: TrainingBudget) -> FineTuneConfig:
    """BatchEnsemble trains as long as a member where it starts from the trained base."""
    return budget.config(0, member=bench.from_scratch)


def train_batch_ensemble(
    bench: Benchmark, budget: TrainingBudget, base: torch.nn.Module, members: int, init_std: float
) -> torch.nn.Module:
    """A BatchEnsemble of the pretrained model (text) or of the trained Single model (image),
    fine-tuned with every member on the training data."""
    start = base if bench.from_scratch else bench.initial(0)
    model = batch_ensemble(start, members, init_std=init_std, seed=0)
    fine_tune(model, bench.train, None, batch_ensemble_settings(bench, budget), progress=True)
    return model


def demo_starting_point(task: str) -> tuple[DemoConfig, Benchmark, torch.nn.Module]:
    """The demo's default configuration, benchmark and trained Single model (from the cache, or
    trained and cached): what baseline-selection scripts start from."""
    config = DemoConfig.preset(task)
    bench = prepare_benchmark(config, load_demo_task(config))
    settings = config.budget.config(0)
    base = Cache(config.cache_dir, True).model(
        "finetuned", model_key(bench, settings), lambda: train_model(bench, settings)
    )
    return config, bench, base


def validation_scores(model: torch.nn.Module, bench: Benchmark) -> dict[str, float]:
    """Classification metrics of ``model`` (any ensemble) on the ID validation split."""
    preds = predict(model, bench.val, progress=False)
    return classification(preds.probs(), preds.labels)


def load_demo_task(config: DemoConfig) -> Task:
    limits = {
        "train_limit": config.train_limit,
        "val_limit": config.val_limit,
        "test_limit": config.test_limit,
        "ood_limit": config.ood_limit,
        "shift_limit": config.shift_limit,
        "seed": config.seed,
    }
    if config.task == "image":
        return load_image_task(**limits)
    return load_text_task(**limits)


class PredictionCache:
    """`predict` that computes each (model, split, precision) once: the deep ensemble's first member
    is the Single model, and the pruning curves start from the unpruned base. An explicit ensemble
    is predicted member by member, so shared members are shared. MC dropout (random) is never
    reused. Models are held, so their ids cannot be reused while the cache lives."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[torch.nn.Module, Predictions]] = {}

    def predict(
        self, model, batches, split: str, mc_samples: int = 0, precision: str = "auto", progress=True
    ):
        if isinstance(model, list):
            parts = [self.predict(m, batches, split, mc_samples, precision, progress) for m in model]
            return Predictions(np.concatenate([p.member_logits for p in parts]), parts[0].labels)
        key = (id(model), split, precision)
        if mc_samples or key not in self._known:
            found = predict(
                model, batches, split, progress=progress, mc_samples=mc_samples, precision=precision
            )
            if mc_samples:
                return found
            self._known[key] = (model, found)
        return self._known[key][1]


class Stage:
    """Prints what runs and how long it took."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        print(f"[{time.perf_counter() - self.start:6.1f}s] {name} ...", flush=True)
        value = fn()
        self.timings[name] = time.perf_counter() - t
        return value


class Cache:
    """Models and JSON artefacts under ``root/<kind>-<hash of key>``."""

    def __init__(self, root: Path, enabled: bool) -> None:
        self.root, self.enabled = Path(root), enabled

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return self.root / f"{kind}-{digest}"

    def model(self, kind: str, key: dict[str, Any], build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        where = self.path(kind, key)
        if self.enabled and (where / "member_config.json").is_file():
            return load_member(where)
        model = build()
        save_member(model, where)
        return model

    def json(self, kind: str, key: dict[str, Any], build: Callable[[], Any]) -> Any:
        where = self.path(kind, key) / "value.json"
        if self.enabled and where.is_file():
            return json.loads(where.read_text())
        value = build()
        atomic_write_json(where, value)
        return value


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the whole experiment; returns the results and writes the report folder."""
    stage = Stage()
    torch.manual_seed(config.seed)
    compute = resolve_precision(config.precision)
    evaluation = resolve_precision(config.eval_precision or compute)
    # the resolved name, not "auto", goes into every cache key: a cache made in bf16 on one
    # machine is not reused as if it were fp32 on another
    config = replace(config, precision=compute.name, budget=replace(config.budget, precision=compute.name))
    print(f"precision: {compute}" + (f"; evaluation in {evaluation.name}" if evaluation != compute else ""))
    task = stage.run("load data", lambda: load_demo_task(config))
    for note in config.scaled_down():
        print(f"  scaled down: {note}")
    bench = stage.run("prepare batches", lambda: prepare_benchmark(config, task))
    train, val = bench.train, bench.val
    cache = Cache(config.cache_dir, config.use_cache)
    # each cached artefact is keyed by the data, the starting model and its own training settings
    # (so that, e.g., a new LoRA learning rate retrains the LoRA members and nothing else)

    # ---------------------------------------------------------------- single model and ensembles
    verb = "train from scratch" if bench.from_scratch else "fine-tune"
    singles = [
        stage.run(
            f"{verb}: model (seed {s})",
            lambda s=s: cache.model(
                "finetuned",
                model_key(bench, config.budget.config(s)),
                lambda: train_model(bench, config.budget.config(s)),
            ),
        )
        for s in range(config.members)
    ]
    base = singles[0]
    base_settings = asdict(config.budget.config(0))
    loras = [
        stage.run(
            f"LoRA fine-tune (seed {s})",
            lambda s=s: cache.model(
                "lora",
                model_key(
                    bench,
                    lora_settings(bench, config.budget, s),
                    rank=config.lora_rank,
                    start=base_settings if bench.from_scratch else "pretrained",
                ),
                lambda: train_lora(bench, config.budget, base, s, config.lora_rank),
            ),
        )
        for s in range(config.members)
    ]

    batch_ensembles = {}
    if config.batch_ensemble:
        be_name = f"BatchEnsemble (M={config.members})"
        be_key = model_key(
            bench,
            batch_ensemble_settings(bench, config.budget),
            members=config.members,
            init_std=config.batch_ensemble_init_std,
            start=base_settings if bench.from_scratch else "pretrained",
        )
        batch_ensembles[be_name] = stage.run(
            f"fine-tune: {be_name}",
            lambda: cache.model(
                "batch-ensemble",
                be_key,
                lambda: train_batch_ensemble(
                    bench, config.budget, base, config.members, config.batch_ensemble_init_std
                ),
            ),
        )

    # ---------------------------------------------------------------- choosing heads
    heads_per_layer = [base.config.num_attention_heads] * base.config.num_hidden_layers
    calib = train[: max(1, 64 // config.budget.batch_size)]
    rank_key = {**bench.key, "base": base_settings, "precision": compute.name}
    taylor = torch.tensor(
        stage.run(
            "Taylor scores",
            lambda: cache.json(
                "taylor-scores", rank_key, lambda: taylor_scores(base, calib, precision=compute.name).tolist()
            ),
        )
    )
    taylor_single = HeadSet.from_dict(
        stage.run(
            "Taylor pruning (prune -> recompute)",
            lambda: cache.json(
                "taylor-heads",
                {**rank_key, "keep": config.heads_per_layer},
                lambda: taylor_head_set(
                    base, calib, config.heads_per_layer, precision=compute.name
                ).to_dict(),
            ),
        )
    )

    circuit_id, circuit_ood = bench.circuit_id, bench.circuit_ood
    circuit_key = {
        **rank_key,
        "budget": config.circuit_budget,
        "id": config.circuit_id_items,
        "ood": config.circuit_ood_items,
        "objective": "avg",
        "length": config.circuit_length,
    }
    checkpoint = cache.path("circuit-progress", circuit_key) / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if not config.use_cache:
        checkpoint.unlink(missing_ok=True)
    order = CircuitOrder.from_dict(
        stage.run(
            "circuit extraction (CircAvg)",
            lambda: cache.json(
                "circuit",
                circuit_key,
                lambda: extract_circuit(
                    base,
                    circuit_id,
                    circuit_ood,
                    "avg",
                    config.circuit_budget,
                    checkpoint=checkpoint,
                    precision=compute.name,
                ).to_dict(),
            ),
        )
    )

    # ---------------------------------------------------------------- members
    members_heads = {
        kind: sample_members(
            ranking,
            config.members,
            num_pruned=config.pruned_per_member,
            pool_size=config.pool_size,
            seed=config.seed,
        )
        for kind, ranking in (("taylor", taylor), ("circ", order))
    }

    def pruned_member(name: str, heads: HeadSet, seed: int, trunk: int = 0) -> torch.nn.Module:
        settings = config.budget.config(seed, member=True)
        if trunk:  # the shared trunk stays as in the base: train only the later blocks
            settings = replace(settings, last_k_blocks=len(heads_per_layer) - trunk)

        def build() -> torch.nn.Module:
            member = prune(base, heads)
            fine_tune(member, train, None, settings, progress=True)
            return member

        key = model_key(bench, settings, base=base_settings, heads=heads.to_dict(), trunk=trunk)
        return stage.run(f"fine-tune {name}", lambda: cache.model("member", key, build))

    circ_single = order.head_set(config.pruned_per_member)
    pruned_singles = {
        "Taylor": pruned_member("Taylor (single pruned)", taylor_single, 0),
        "CircAvg": pruned_member("CircAvg (single pruned)", circ_single, 0),
    }
    member_models = {
        kind: [pruned_member(f"{kind} member {m}", hs, m) for m, hs in enumerate(sets)]
        for kind, sets in members_heads.items()
    }
    hydras = {
        "Hydra (Taylor)": fuse(member_models["taylor"], mlp="merge").eval(),
        "Hydra (Circ)": fuse(member_models["circ"], mlp="merge").eval(),
    }
    trunk_names = []
    for trunk in sorted({len(heads_per_layer) // 3, len(heads_per_layer) // 2}) if config.trunk_study else []:
        heads = sample_members(
            order,
            config.members,
            num_pruned=config.pruned_per_member,
            pool_size=config.pool_size,
            seed=config.seed,
            shared_layers=trunk,
        )
        models = [
            pruned_member(f"circ member {m} (trunk {trunk})", hs, m, trunk) for m, hs in enumerate(heads)
        ]
        name = f"Hydra (Circ, shared trunk {trunk}/{len(heads_per_layer)})"
        hydras[name] = fuse(models, mlp="merge").eval()
        trunk_names.append(name)

    # ---------------------------------------------------------------- predictions
    test, oods, shifted = bench.test, bench.oods, bench.shifted
    methods: dict[str, Any] = {
        "Single": (base, 0),
        "MC Dropout": (base, config.mc_samples),
        f"Deep Ensemble (M={config.members})": (singles, 0),
        f"LoRA-Ensemble (M={config.members})": (loras, 0),
        **{name: (model, 0) for name, model in batch_ensembles.items()},
        "Taylor (single pruned)": (pruned_singles["Taylor"], 0),
        "CircAvg (single pruned)": (pruned_singles["CircAvg"], 0),
        **{name: (model, 0) for name, model in hydras.items()},
    }

    known = PredictionCache()

    def predictions(name: str, model, mc: int, precision: str = evaluation.name) -> dict[str, Any]:
        torch.manual_seed(config.seed)  # MC dropout masks
        run = partial(known.predict, model, mc_samples=mc, precision=precision)
        out = {"test": run(test, "test")}
        if name in ("Single", "Hydra (Circ)"):  # validation predictions serve temperature scaling
            out["val"] = run(val, "val")
        out["ood"] = {n: (k, run(b, n)) for n, (k, b) in oods.items()}
        out["shift"] = {key: run(b, f"{key[0]}@{key[1]}") for key, b in shifted.items()}
        return out

    preds = {
        name: stage.run(f"predict: {name}", lambda n=name, m=model, mc=mc: predictions(n, m, mc))
        for name, (model, mc) in methods.items()
    }
    if evaluation.reduced:  # how much does reduced precision move Hydra's numbers? (fp32 reference row)
        fp32_name = "Hydra (Circ), fp32 evaluation"
        preds[fp32_name] = stage.run(
            f"predict: {fp32_name}", lambda: predictions("fp32", hydras["Hydra (Circ)"], 0, precision="fp32")
        )

    # ---------------------------------------------------------------- metrics
    results: dict[str, Any] = {}
    temperatures: dict[str, float] = {}
    for name, p in preds.items():
        results[name] = evaluate_predictions(p["test"], p["ood"], p["shift"])
        if "val" in p:  # temperature scaling: fit on the ID validation split only
            shared = float(fit_temperature(p["val"]))
            temperatures[f"{name} + TS"] = shared
            results[f"{name} + TS"] = evaluate_predictions(
                p["test"], p["ood"], p["shift"], temperature=shared
            )
            if p["val"].num_members > 1:  # one temperature per member, each fit on its own NLL
                per_member = fit_temperature(p["val"], per_member=True)
                temperatures[f"{name} + TS per member"] = per_member.tolist()
                results[f"{name} + TS per member"] = evaluate_predictions(
                    p["test"], p["ood"], p["shift"], temperature=per_member
                )
    order_names = [
        "Single",
        "Single + TS",
        "MC Dropout",
        f"Deep Ensemble (M={config.members})",
        f"LoRA-Ensemble (M={config.members})",
        *batch_ensembles,
        "Taylor (single pruned)",
        "CircAvg (single pruned)",
        "Hydra (Taylor)",
        "Hydra (Circ)",
        "Hydra (Circ) + TS",
        "Hydra (Circ) + TS per member",
        *(["Hydra (Circ), fp32 evaluation"] if evaluation.reduced else []),
        *trunk_names,
    ]
    results = {n: results[n] for n in order_names}
    full_heads, layers = heads_per_layer[0], len(heads_per_layer)
    kept_avg = (sum(heads_per_layer) - config.pruned_per_member) / layers
    heads_label = {n: f"{full_heads}/{full_heads}" for n in order_names}
    heads_label["Taylor (single pruned)"] = f"{config.heads_per_layer}/{full_heads}"
    for n in order_names:
        if n.startswith(("Hydra", "CircAvg")):
            heads_label[n] = f"avg {kept_avg:.0f}/{full_heads}"

    # ---------------------------------------------------------------- metrics vs heads pruned (Fig. 5)
    curves = stage.run(
        "zero-shot pruning curves",
        lambda: _pruning_curves(
            base, {"Taylor": taylor, "CircAvg": order}, test, oods, config, evaluation, known
        ),
    )

    # ---------------------------------------------------------------- cost
    cost = stage.run(
        "cost benchmark", lambda: _cost(base, singles, hydras, test[0], config, compute, batch_ensembles)
    )

    # ---------------------------------------------------------------- report
    out = Path(config.out_dir)
    meta = {
        "command": config.command,
        "machine": describe_machine(),
        "precision": str(compute) + ("" if evaluation == compute else f"; evaluation in {evaluation}"),
        "model": f"{config.model} ({type(base).__name__}, {len(heads_per_layer)} layers x "
        f"{heads_per_layer[0]} heads{', trained from scratch' if bench.from_scratch else ''})",
        **{f"data: {k}": v for k, v in task.describe().items()},
        "training budget (all methods)": json.dumps(asdict(config.budget)),
        "seeds": f"members/ensembles use seeds 0..{config.members - 1}; base seed {config.seed}",
        "temperatures (fit on ID val)": json.dumps(
            {
                k: round(v, 3) if isinstance(v, float) else [round(x, 3) for x in v]
                for k, v in temperatures.items()
            }
        ),
        "member overlap (Jaccard, mean off-diagonal)": ", ".join(
            f"{k}: {_mean_offdiag(member_overlap(v, heads_per_layer)):.2f}" for k, v in members_heads.items()
        ),
        "scaled down": "; ".join(config.scaled_down()),
        "wall time (s)": f"{time.perf_counter() - stage.start:.0f}",
    }
    reporting.write_results(
        out, results, heads_label, meta, title=f"Hydra Ensembles: {config.task} benchmark (demo)"
    )
    _write_cost(out, cost)
    _plots(out, preds, members_heads, heads_per_layer, taylor, order, config.members)
    reporting.metrics_vs_pruned(curves, out / "plots" / "metrics_vs_pruned.png")
    atomic_write_json(out / "pruning_curves.json", curves)
    atomic_write_json(out / "timings.json", stage.timings)
    print()
    print(_console_table(results, heads_label))
    print(
        f"\ncost ({cost['precision']}, batch of {cost['input']}): "
        + ", ".join(
            f"{k} {v['latency_ms']:.0f} ms / {v['params'] / 1e6:.1f}M params / {v['gmacs']:.1f} GMAC"
            for k, v in cost["methods"].items()
        )
    )
    print(f"report: {out / 'report.md'} (+ results.json, results.csv, cost.json, plots/)")
    print(f"done in {time.perf_counter() - stage.start:.0f} s")
    return {"results": results, "cost": cost, "meta": {**meta, "wall_s": time.perf_counter() - stage.start}}


def _mean_offdiag(matrix: np.ndarray) -> float:
    m = matrix.shape[0]
    return float((matrix.sum() - np.trace(matrix)) / (m * m - m)) if m > 1 else 1.0


def _cost(
    base,
    singles,
    hydras: dict[str, Any],
    batch,
    config: DemoConfig,
    compute: Precision,
    others: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Latency (interleaved, in ``compute``: what the user runs), parameters and multiply-adds of
    Single, Deep Ensemble, the Circ Hydra models (including shared-trunk variants when built) and
    ``others`` (e.g. a BatchEnsemble). Models are timed as copies in ``compute``'s dtype."""
    inputs = model_inputs(batch)
    chosen = {name: h for name, h in hydras.items() if name.startswith("Hydra (Circ")}
    models: dict[str, Any] = {"Single": base, "Deep Ensemble": singles, **(others or {}), **chosen}
    models = {
        k: [in_precision(x, compute) for x in m] if isinstance(m, list) else in_precision(m, compute)
        for k, m in models.items()
    }

    def runner(model):
        return (
            partial(_run_all, model, inputs) if isinstance(model, list) else partial(_run_one, model, inputs)
        )

    runs = {k: runner(m) for k, m in models.items()}
    with torch.inference_mode():
        times = {
            k: median(v) for k, v in interleaved_latency(runs, repeats=config.bench_repeats, warmup=1).items()
        }
        macs = {k: multiply_adds(r) for k, r in runs.items()}
    params = {
        k: sum(count_parameters(x) for x in m) if isinstance(m, list) else count_parameters(m)
        for k, m in models.items()
    }
    return {
        "batch": int(batch["labels"].shape[0]),
        "input": _describe_input(inputs),
        "precision": compute.name,
        "precision_reason": compute.reason,
        "methods": {
            k: {"latency_ms": 1e3 * times[k], "params": params[k], "gmacs": macs[k] / 1e9} for k in runs
        },
    }


def _pruning_curves(
    base,
    rankings: dict[str, Any],
    test,
    oods,
    config: DemoConfig,
    evaluation: Precision,
    known: PredictionCache,
) -> dict[str, Any]:
    """Zero-shot: prune the first n heads of each ranking, measure accuracy, ECE, AUROC and FPR95
    (MSP, near/far average) on the test sets (the paper's Figure 5)."""
    steps = sorted({0, *range(config.curve_step, config.pool_size + 1, config.curve_step), config.pool_size})
    curves: dict[str, dict[str, list]] = {m: {} for m in ("accuracy", "ECE", "AUROC", "FPR95")}
    for method, ranking in rankings.items():
        order, counts = least_useful_first(ranking)
        for n in steps:
            gone = set(order[:n])
            heads = HeadSet(
                {lay: [h for h in range(c) if (lay, h) not in gone] for lay, c in enumerate(counts)}
            )
            model = prune(base, heads) if n else base  # nothing pruned: the base, already predicted
            run = partial(known.predict, model, progress=False, precision=evaluation.name)
            p_test = run(test, "test")
            p_ood = {name: (kind, run(b, name)) for name, (kind, b) in oods.items()}
            result = evaluate_predictions(p_test, p_ood, scores=("msp",))
            average = result["ood_summary"]["msp"]["average"]
            for metric, value in (
                ("accuracy", result["classification"]["acc"]),
                ("ECE", result["classification"]["ece"]),
                ("AUROC", average["auroc"]),
                ("FPR95", average["fpr95"]),
            ):
                curves[metric].setdefault(method, []).append((n, value))
    return curves


def _describe_input(inputs: dict[str, torch.Tensor]) -> str:
    """``"64 x 32 tokens"`` or ``"64 images of 1x28x28"``."""
    if "input_ids" in inputs:
        batch, tokens = inputs["input_ids"].shape
        return f"{batch} x {tokens} tokens"
    pixels = inputs["pixel_values"]
    return f"{pixels.shape[0]} images of {'x'.join(str(d) for d in pixels.shape[1:])}"


def _run_one(model, inputs):
    return model(**inputs)


def _run_all(models, inputs):
    return [m(**inputs) for m in models]


def _write_cost(out: Path, cost: dict[str, Any]) -> None:
    atomic_write_json(out / "cost.json", cost)
    single = cost["methods"]["Single"]
    lines = [
        "",
        f"## Cost ({cost['precision']}: {cost['precision_reason']}; batch of {cost['input']}, "
        "median latency)",
        "",
        "| Method | Latency (ms) | x Single | Params (M) | GMAC |",
        "|---|---|---|---|---|",
    ]
    for name, row in cost["methods"].items():
        lines.append(
            f"| {name} | {row['latency_ms']:.0f} | {row['latency_ms'] / single['latency_ms']:.2f} | "
            f"{row['params'] / 1e6:.1f} | {row['gmacs']:.1f} |"
        )
    report = out / "report.md"
    from .io import atomic_write_text

    atomic_write_text(report, report.read_text() + "\n".join(lines) + "\n")


def _plots(out: Path, preds, members_heads, heads_per_layer, taylor, order, members: int) -> None:
    plots = out / "plots"
    labels = preds["Single"]["test"].labels
    chosen = ["Single", f"Deep Ensemble (M={members})", "Hydra (Circ)"]
    chosen = [c for c in chosen if c in preds]
    reporting.reliability_diagram(
        {m: preds[m]["test"].probs() for m in chosen}, labels, plots / "reliability.png"
    )
    hydra = preds["Hydra (Circ)"]
    conf = {"ID test": hydra["test"].probs().max(-1)}
    conf.update({n: p.probs().max(-1) for n, (_, p) in hydra["ood"].items()})
    reporting.confidence_histograms(conf, plots / "confidence_hydra_circ.png", "Hydra (Circ): confidence")
    reporting.roc_curves(
        ood_scores(hydra["test"], "msp"),
        {n: ood_scores(p, "msp") for n, (_, p) in hydra["ood"].items()},
        plots / "roc_hydra_circ.png",
        "Hydra (Circ), MSP",
    )
    for kind, sets in members_heads.items():
        reporting.heads_map(sets, heads_per_layer, plots / f"heads_{kind}.png")
    reporting.score_heatmap(np.asarray(taylor), plots / "taylor_scores.png", "Taylor importance", "score")
    reporting.score_heatmap(
        removal_ranking(order), plots / "circuit_order.png", "CircAvg removal step (blank = kept)", "step"
    )


def _console_table(results: dict[str, Any], heads: dict[str, str]) -> str:
    cols = [
        ("acc", "Acc"),
        ("brier", "Brier"),
        ("nll", "NLL"),
        ("ece", "ECE"),
        ("aece", "aECE"),
        ("auroc", "AUROC"),
        ("fpr95", "FPR95"),
        ("aupr_in", "AUPR-In"),
    ]
    lines = [f"{'Method':30s} {'Heads':>7s} " + " ".join(f"{h:>7s}" for _, h in cols)]
    for name, result in results.items():
        row = reporting.main_row(result)
        cells = [f"{100 * row[k]:7.2f}" if k not in ("brier", "nll") else f"{row[k]:7.3f}" for k, _ in cols]
        lines.append(f"{name:30s} {heads[name]:>7s} " + " ".join(cells))
    return "\n".join(lines)
