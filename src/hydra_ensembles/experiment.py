"""The paper's experiment on an embedded benchmark, end to end (``hydra-ens demo``).

Text (default): MiniLM-L6 fine-tuned on BBC News; image: DINOv2-S/14 (pretrained, converted from
an offline ONNX graph) fine-tuned on Fashion-MNIST at 56 pixels, or with ``--model vit-6x12-p7`` a
small ViT trained from scratch (``tasks`` describes the data). Fine-tune (or train) the base ->
Taylor scores and circuit extraction -> members -> fine-tune members -> fuse -> evaluate every
method (Single, temperature scaling, MC dropout, Deep Ensembles of M fine-tunes and (D) of M
heads on one backbone, LoRA-Ensemble, single pruned models, Hydra) -> cost benchmark -> report.

Every method gets the same training recipe: the same training data, epochs, learning rate,
schedule, batch size and token length (`TrainingRecipe`), with no early stopping (so no
per-epoch validation pass either: the validation split serves temperature scaling and
selection scripts only); members start from the fine-tuned base
(as in the paper's post-pruning fine-tuning), the other methods from the pretrained model. A
model trained from scratch (the small ViT) trains Single and every Deep-Ensemble member from
scratch (seeds 0..M-1), and LoRA-Ensemble members adapt the trained Single model (seeds 0..M-1)
for as many epochs as pruned members get.
Expensive artefacts (fine-tuned models, rankings) are cached under ``cache_dir``, keyed by a hash
of everything they depend on, so a second run is fast.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import reporting
from .batching import model_inputs
from .build import Build, BuildConfig, build_hydra
from .cost import count_parameters, interleaved_latency, median, multiply_adds
from .data import to_batches as data_batches
from .evaluation import (
    EvalData,
    MethodPredictions,
    Predictions,
    add_comparisons,
    add_intervals,
    bootstrap_draws,
    evaluate_method,
    evaluate_predictions,
    main_row,
    predict,
    predict_method,
)
from .heads import HeadSet
from .io import atomic_write, atomic_write_json, atomic_write_text, batches_digest, update_with_tensor
from .members import (
    FineTuneConfig,
    head_ensemble,
    load_member,
    member_overlap,
    sample_members,
    save_member,
    train_head_ensemble,
)
from .members.batch_ensemble import batch_ensemble
from .members.ensemble import DeepEnsemble, has_dropout
from .members.finetune import fine_tune
from .members.lora import lora_fine_tune
from .members.mimo import mimo, train_mimo
from .members.packed import packed_ensemble
from .members.sampling import least_useful_first
from .members.unstructured import make_permanent, matched_sparsity, unstructured_prune
from .metrics import classification
from .models import (
    DEFAULT_IMAGE_MODEL,
    DEFAULT_TEXT_MODEL,
    SCRATCH_IMAGE_MODEL,
    SMALL_VITS,
    load_classifier,
    load_image_processor,
    load_tokenizer,
    small_vit,
)
from .precision import Precision, in_precision, resolve_precision
from .runtime import describe_machine
from .scoring import CircuitOrder, extract_circuit, removal_ranking, taylor_head_set, taylor_scores
from .scoring.taylor import DECIDING_PRECISION
from .surgery import heads_per_layer as heads_per_layer_of
from .surgery import prune
from .tasks import Dataset, Task, load_image_task, load_text_task


@dataclass(frozen=True)
class TrainingRecipe:
    """The one training recipe every method uses (written into the report)."""

    epochs: int = 2
    member_epochs: int = 1
    lr: float = 3e-4
    lora_lr_scale: float = 20.0
    """LoRA adapters train with this multiple of ``lr``, chosen on ID validation (docs/design-notes.md)."""
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
            shuffle="batches",  # the benchmarks' data are mixed once by a hash of their ids
        )


TASKS = ("text", "image", "zero-shot")
"""The demo's tasks: supervised text and image, and zero-shot text with a dual encoder."""

IMAGE_RECIPE = TrainingRecipe(
    epochs=5,
    member_epochs=2,
    lr=1e-3,
    lora_lr_scale=1.0,
    batch_size=64,
    weight_decay=0.05,
    trainable=("attention", "mlp", "norm", "head", "embeddings"),
)
"""Training the small ViT from scratch: more epochs and a larger step than fine-tuning; LoRA at
the same rate (chosen on ID validation: docs/design-notes.md)."""

PRETRAINED_IMAGE_RECIPE = TrainingRecipe(
    epochs=1, member_epochs=1, lr=1e-4, lora_lr_scale=10.0, batch_size=32, weight_decay=0.05
)
"""Fine-tuning DINOv2-S at 56 px, the embeddings frozen as in the paper (D.2); the rate chosen on
ID validation (docs/design-notes.md)."""


PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "text": (
        {},
        {
            "max_length": 96,
            "train_limit": None,
            "val_limit": None,
            "ood_limit": None,
            "shift_limit": 100,
            "circuit_id_items": 48,
            "circuit_ood_items": 48,
            "circuit_length": 64,
            "curve_step": 8,
            "eval_precision": "fp32",
            "mc_samples": 8,
            "recipe": TrainingRecipe(epochs=3, member_epochs=1),
        },
    ),
    "image": (  # DINOv2-S, pretrained
        {
            "task": "image",
            "model": DEFAULT_IMAGE_MODEL,
            "out_dir": Path("runs/demo-image"),
            "train_limit": 1600,
            "val_limit": 400,
            "test_limit": 1000,
            "ood_limit": 200,
            "shift_limit": 30,
            "heads_per_layer": 5,
            "num_pruned": 12,  # 12 of 72 heads (1/6): Taylor keeps 5 of 6 per layer
            "pool_size": 24,
            "circuit_budget": 24,
            "circuit_id_items": 16,
            "circuit_ood_items": 16,
            "curve_step": 8,
            "eval_batch_size": 128,
            "recipe": PRETRAINED_IMAGE_RECIPE,
        },
        {
            "train_limit": 10000,
            "val_limit": None,
            "test_limit": None,
            "ood_limit": 1000,
            "shift_limit": 200,
            "heads_per_layer": 4,
            "num_pruned": 24,  # the paper's share: 8 of 12 heads kept, here 4 of 6
            "pool_size": 48,
            "circuit_budget": 48,
            "circuit_id_items": 64,
            "circuit_ood_items": 64,
            "eval_precision": "fp32",
            "recipe": replace(PRETRAINED_IMAGE_RECIPE, epochs=2),
        },
    ),
    "image-scratch": (  # the small ViT trained from scratch
        {
            "task": "image",
            "model": SCRATCH_IMAGE_MODEL,
            "out_dir": Path("runs/demo-image"),
            "train_limit": 6000,
            "val_limit": 1000,
            "test_limit": 2000,
            "ood_limit": 500,
            "shift_limit": 200,
            "circuit_id_items": 64,
            "circuit_ood_items": 64,
            "recipe": IMAGE_RECIPE,
            "batch_ensemble_init_std": 0.05,
        },
        {
            "train_limit": 30000,
            "val_limit": None,
            "test_limit": None,
            "ood_limit": 1000,
            "shift_limit": 500,
            "circuit_id_items": 256,
            "circuit_ood_items": 256,
            "eval_precision": "fp32",
            "mc_samples": 8,
            "recipe": replace(IMAGE_RECIPE, epochs=3, member_epochs=1),
        },
    ),
    "zero-shot": (  # no training: nothing to fine-tune, only to score and prune
        {
            "task": "zero-shot",
            "out_dir": Path("runs/demo-zero-shot"),
            "max_length": 24,
            "train_limit": 64,
            "val_limit": 200,
            "ood_limit": 100,
            "shift_limit": 10,
            "circuit_id_items": 12,
            "circuit_ood_items": 12,
            "circuit_length": 16,
            "num_pruned": 12,  # 12 of 144 heads: the paper's share (24 of CLIP's 288)
            "pool_size": 24,
            "circuit_budget": 24,
            "curve_step": 12,
        },
        {  # all-mpnet-base-v2 (BERT-base size, 288 heads in the pool), every test text
            "model": "all-mpnet-base-v2",
            "max_length": 128,
            "val_limit": None,
            "ood_limit": None,
            "shift_limit": 20,
            "circuit_id_items": 16,
            "circuit_ood_items": 16,
            "circuit_length": 32,
            "num_pruned": 24,  # 24 of 288 heads: the paper's count on CLIP ViT-B/32
            "pool_size": 48,
            "circuit_budget": 48,
            "curve_step": 24,
            "eval_precision": "fp32",
        },
    ),
}
"""`DemoConfig.preset`'s table: per task (and image model kind), the fields of the default
protocol and what ``full`` changes on top of them."""


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
    num_pruned: int = 24
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
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)
    eval_batch_size: int = 64
    seed: int = 0
    cache_dir: Path = Path("runs/cache")
    out_dir: Path = Path("runs/demo")
    use_cache: bool = True
    bench_repeats: int = 5
    bootstrap: int = 200
    """Bootstrap resamples of the test items for every row's 95% intervals and the paired
    differences of the methods a `Method` is compared with (``compare_with``); 0: none."""
    trunk_study: bool = False
    """Also build Hydra (Circ) with a shared trunk of L/3 and L/2 layers (members diverse and
    fine-tuned only after it) and report its quality and cost beside full Hydra."""
    batch_ensemble: bool = False
    """Also report a BatchEnsemble of M members (the paper's baseline), converted from the
    pretrained model (text) or the trained Single model (image) and fine-tuned."""
    packed: bool = False
    """Also report Packed-Ensembles of M members: the paper's setting (alpha=2, trained from
    scratch: members too narrow for the pretrained weights) and, where a pretrained model exists,
    alpha=M from the pretrained weights (each member full width: a deep ensemble in one pass)."""
    mimo: bool = False
    """Also report MIMO with M members (input repetition ``mimo_rho``, batch repetition
    ``mimo_batch_repeat``), started from the pretrained model (text, DINOv2) or the trained
    Single model (the small ViT from scratch)."""
    mimo_rho: float = 0.5
    mimo_batch_repeat: int = 4
    """The paper's MIMO settings (C.1.4): rho=0.5, batch_repeat=4."""
    oba: bool = False
    """Also report the paper's unstructured baseline, OBA (`members.unstructured`): the weights
    with the lowest second-order Taylor scores (exact Hessian-vector product on the calibration
    batches), as many as Taylor's single pruned model removes parameters, then fine-tuned like it
    with its zeros kept."""
    wanda: bool = False
    """Also report Wanda, pruning as many weights the same way (|W| x input norm, per output row)."""
    batch_ensemble_init_std: float = 0.1
    """Spread of BatchEnsemble's rank-1 factors around 1, chosen on ID validation NLL
    (``benchmarks/batch_ensemble_std.py``; docs/design-notes.md)."""

    @classmethod
    def preset(cls, task: str = "text", full: bool = False, **overrides) -> DemoConfig:
        """The default (about 5 minutes for text here) or ``full`` protocol of a task.

        Text full: every training text, 96 tokens, 3 epochs, circuit extraction on 48 + 48 texts
        of 64 tokens, fp32 evaluation of every test text. Image (DINOv2-S at 56 px): 1,600 training
        images, one epoch, 12 of 72 heads pruned per member, circuits on 16 + 16 images; image
        full: 10,000 training images, two epochs, 24 of 72 heads pruned per member (the paper's
        share), circuits on 64 + 64 images, all 8,000 ID test images, fp32 evaluation. The small
        ViT from scratch (``model="vit-6x12-p7"``): 6,000 training images, 5 epochs; full: 30,000
        images, 3 epochs, circuits on 256 + 256 images. Zero-shot full: all-mpnet-base-v2 as the dual
        encoder, 128 tokens, every validation and OOD text, circuits on 16 + 16 texts of 32 tokens,
        24 of its 288 heads pruned per member, fp32 evaluation.
        """
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")
        scratch = task == "image" and overrides.get("model", DEFAULT_IMAGE_MODEL) in SMALL_VITS
        default, larger = PRESETS["image-scratch" if scratch else task]
        return cls(**{**default, **(larger if full else {}), **overrides}, full=full)

    @property
    def command(self) -> str:
        return (
            "hydra-ens demo"
            + (f" --task {self.task}" if self.task != "text" else "")
            + (" --full" if self.full else "")
        )

    def model_seed(self, index: int) -> int:
        """The training seed of model ``index`` (Single and ensemble members 0..M-1, pruned
        members, LoRA members) in a run of ``seed``: ``100 * seed + index``, so runs of different
        seeds share no model and seed 0 keeps seeds 0..M-1."""
        return 100 * self.seed + index

    def sample_member_heads(
        self, ranking: Any, shared_layers: int = 0, count: int | None = None
    ) -> list[HeadSet]:
        """``count`` (default ``members``) head sets, each pruning ``num_pruned`` heads
        drawn (from ``seed``) from the ``pool_size`` least useful of ``ranking``; member m's set
        does not depend on ``count``."""
        return sample_members(
            ranking,
            self.members if count is None else count,
            num_pruned=self.num_pruned,
            pool_size=self.pool_size,
            seed=self.seed,
            shared_layers=shared_layers,
        )

    def scaled_down(self) -> list[str]:
        """What this configuration shrinks relative to the paper's protocol, in words."""
        text = self.task != "image"
        items = "texts" if text else "images"
        start = "trained from scratch" if self.model in SMALL_VITS else "fine-tuned"
        notes = [f"texts truncated to {self.max_length} tokens"] if text else []
        if self.task != "zero-shot":
            notes.append(
                f"base and deep-ensemble members {start} {self.recipe.epochs} epoch(s); pruned members "
                f"fine-tuned {self.recipe.member_epochs} epoch(s) from the base"
            )
        notes += [
            f"circuit extraction on {self.circuit_id_items} ID + {self.circuit_ood_items} OOD validation "
            f"{items}" + (f" of {self.circuit_length} tokens" if text else ""),
        ]
        if self.train_limit and self.task != "zero-shot":
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
    preprocessor: Any = None
    """The tokenizer or image processor the batches were made with (None: raw pixels)."""

    def batches(self, data: Dataset, length: int, batch_size: int = 64) -> list[dict]:
        """More batches made like the benchmark's (texts cut to ``length`` tokens)."""
        return list(data_batches(data, self.preprocessor, batch_size, length))


def _data_key(dataset: Dataset) -> str:
    return hashlib.sha256("\n".join(dataset.ids).encode()).hexdigest()[:16]


def prepare_benchmark(config: DemoConfig, task: Task) -> Benchmark:
    """Batches for every split, OOD set, shifted set and the circuit-extraction data."""
    classes = len(task.classes)
    from_scratch = config.model in SMALL_VITS
    if config.task == "image":  # the pretrained model's image processor; none from scratch
        preprocessor = None if from_scratch else load_image_processor(config.model)
    else:
        preprocessor = load_tokenizer(config.model)

    def to_batches(
        data: Dataset, batch_size: int = config.eval_batch_size, length: int = config.max_length
    ) -> list[dict]:  # images ignore the length
        return list(data_batches(data, preprocessor, batch_size, length))

    def initial(seed: int) -> torch.nn.Module:
        if from_scratch:
            return small_vit(config.model, num_labels=classes, seed=seed)
        return load_classifier(config.model, num_labels=classes, seed=seed)

    def head(data: Dataset, count: int) -> Dataset:
        return data.subset(range(min(count, len(data))))

    return Benchmark(
        task=task,
        train=to_batches(task.train, config.recipe.batch_size),
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
        preprocessor=preprocessor,
        key={
            "model": config.model,
            "train": _data_key(task.train),
            "val": _data_key(task.val),
            "length": config.max_length if config.task != "image" else None,
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


def lora_settings(bench: Benchmark, recipe: TrainingRecipe, seed: int) -> FineTuneConfig:
    """LoRA members train as long as pruned members where they start from the trained base."""
    return recipe.config(seed, member=bench.from_scratch, lora=True)


def train_lora(
    bench: Benchmark, recipe: TrainingRecipe, base: torch.nn.Module, seed: int, rank: int
) -> torch.nn.Module:
    """A merged LoRA member: adapters on the pretrained model (text) or, with nothing pretrained
    (image), on the trained Single model ``base``."""
    start = base if bench.from_scratch else bench.initial(seed)
    merged, _ = lora_fine_tune(start, bench.train, None, lora_settings(bench, recipe, seed), rank=rank)
    return merged


def batch_ensemble_settings(bench: Benchmark, recipe: TrainingRecipe) -> FineTuneConfig:
    """BatchEnsemble trains as long as a member where it starts from the trained base."""
    return recipe.config(0, member=bench.from_scratch)


def train_batch_ensemble(
    bench: Benchmark, recipe: TrainingRecipe, base: torch.nn.Module, members: int, init_std: float
) -> torch.nn.Module:
    """A BatchEnsemble of the pretrained model (text) or of the trained Single model (image),
    fine-tuned with every member on the training data."""
    start = base if bench.from_scratch else bench.initial(0)
    model = batch_ensemble(start, members, init_std=init_std, seed=0)
    fine_tune(model, bench.train, None, batch_ensemble_settings(bench, recipe), progress=True)
    return model


def packed_settings(bench: Benchmark, recipe: TrainingRecipe, from_pretrained: bool) -> FineTuneConfig:
    """Packed-Ensembles from the pretrained weights train like a fine-tuned model; from scratch
    they train every part (embeddings too) with the from-scratch ViT's step, ``IMAGE_RECIPE.lr``
    (untuned for this model), for the same number of epochs as every other method."""
    settings = recipe.config(0)
    if from_pretrained:
        return settings
    return replace(settings, lr=IMAGE_RECIPE.lr, trainable=IMAGE_RECIPE.trainable)


def train_packed(
    bench: Benchmark, settings: FineTuneConfig, members: int, alpha: int, from_pretrained: bool
) -> torch.nn.Module:
    """A Packed-Ensemble of ``bench``'s model, from the pretrained weights (alpha == M) or from
    the family's random initialisation."""
    model = packed_ensemble(bench.initial(0), members, alpha, from_base=from_pretrained, seed=0)
    fine_tune(model, bench.train, None, settings, progress=True)
    return model


def mimo_settings(bench: Benchmark, recipe: TrainingRecipe) -> FineTuneConfig:
    """MIMO trains like BatchEnsemble, its image input layer (the patch projection) too."""
    settings = batch_ensemble_settings(bench, recipe)
    if "pixel_values" in bench.train[0] and "embeddings" not in settings.trainable:
        settings = replace(settings, trainable=(*settings.trainable, "embeddings"))
    return settings


def train_mimo_model(
    bench: Benchmark, recipe: TrainingRecipe, base: torch.nn.Module, members: int, rho: float, repeat: int
) -> torch.nn.Module:
    """MIMO from the pretrained model (or, with nothing pretrained, the trained Single ``base``)."""
    start = base if bench.from_scratch else bench.initial(0)
    model = mimo(start, members, seed=0)
    train_mimo(model, bench.train, mimo_settings(bench, recipe), rho=rho, batch_repeat=repeat)
    return model


def head_ensemble_settings(recipe: TrainingRecipe) -> FineTuneConfig:
    """Deep Ensembles (D): the heads train on the frozen backbone's cached output until the ID
    validation NLL stops improving (patience 3, at most 30 epochs), at lr 1e-3, a linear probe's
    usual step (not tuned here). One epoch at the backbone's fine-tuning step, the first recipe,
    left three fresh heads badly under-fit (DINOv2: ECE 28%)."""
    return replace(recipe.config(0), epochs=30, lr=1e-3, patience=3)


def train_heads(
    bench: Benchmark, settings: FineTuneConfig, base: torch.nn.Module, members: int
) -> torch.nn.Module:
    """Deep Ensembles (D): ``members`` task heads (seeds 0..M-1) trained with ``settings`` on the
    frozen backbone of the fine-tuned ``base``, early-stopped on the ID validation split."""
    model = head_ensemble(base, members, seed=0)
    train_head_ensemble(model, bench.train, settings, val=bench.val)
    return model


def demo_starting_point(task: str) -> tuple[DemoConfig, Benchmark, torch.nn.Module]:
    """The demo's default configuration, benchmark and trained Single model (from the cache, or
    trained and cached): what baseline-selection scripts start from."""
    config = DemoConfig.preset(task)
    bench = prepare_benchmark(config, load_demo_task(config))
    settings = config.recipe.config(0)
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
    (a list or a `DeepEnsemble`) is predicted member by member, so shared members are shared. MC
    dropout (random) is never reused. Models are held, so their ids cannot be reused while the
    cache lives.

    With a ``root`` folder, predictions also persist there (safetensors, written atomically), keyed
    by a fingerprint of the model (its type, structure and every parameter and buffer), the inputs
    and the precision: a rerun or an interrupted long run resumes without predicting again, and a
    changed model or input is never served old predictions."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = None if root is None else Path(root)
        self._known: dict[tuple, tuple[torch.nn.Module, Predictions]] = {}
        self._fingerprints: dict[int, str] = {}

    def predict(
        self, model, batches, split: str, mc_samples: int = 0, precision: str = "auto", progress=True
    ) -> Predictions:
        if isinstance(model, DeepEnsemble):
            model = list(model.members)
        if isinstance(model, list):
            parts = [self.predict(m, batches, split, mc_samples, precision, progress) for m in model]
            return Predictions(np.concatenate([p.member_logits for p in parts]), parts[0].labels)
        if mc_samples:
            return predict(
                model, batches, split, progress=progress, mc_samples=mc_samples, precision=precision
            )
        key = (id(model), split, precision)
        if key not in self._known:
            self._known[key] = (model, self._stored(model, batches, split, precision, progress))
        return self._known[key][1]

    def _stored(self, model, batches, split: str, precision: str, progress: bool) -> Predictions:
        if self.root is None:
            return predict(model, batches, split, progress=progress, precision=precision)
        batches = list(batches)
        digest = hashlib.sha256(
            f"{self._fingerprint(model)}|{batches_digest(batches)}|{precision}".encode()
        ).hexdigest()[:24]
        path = self.root / f"{digest}.safetensors"
        if path.is_file():
            stored = load_file(str(path))
            labels = stored.get("labels")
            return Predictions(stored["member_logits"].numpy(), None if labels is None else labels.numpy())
        found = predict(model, batches, split, progress=progress, precision=precision)
        tensors = {"member_logits": torch.from_numpy(np.ascontiguousarray(found.member_logits))}
        if found.labels is not None:
            tensors["labels"] = torch.from_numpy(np.ascontiguousarray(found.labels))
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"split": split}))
        return found

    def _fingerprint(self, model: torch.nn.Module) -> str:
        if id(model) not in self._fingerprints:
            self._fingerprints[id(model)] = module_fingerprint(model)
        return self._fingerprints[id(model)]


def module_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of a module's type, structure (``repr``), every submodule's plain settings (numbers,
    strings, tuples, dataclasses such as a zero-shot config) and every parameter and buffer (names,
    dtypes, shapes and bytes): equal fingerprints mean the same computation."""
    digest = hashlib.sha256(f"{type(model).__qualname__}\n{model!r}".encode())
    for path, module in model.named_modules(remove_duplicate=False):
        for name, value in sorted(vars(module).items()):
            if not name.startswith("_") and name != "training" and _is_setting(value):
                digest.update(re.sub(r"0x[0-9a-f]+", "", f"{path}.{name}={value!r}").encode())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        update_with_tensor(digest, name, tensor)
    return digest.hexdigest()


def _is_setting(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))) or is_dataclass(value):
        return True
    return isinstance(value, (tuple, list)) and all(_is_setting(v) for v in value)


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

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


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

    def predictions(self) -> PredictionCache:
        """A `PredictionCache` persisting under ``root/predictions`` (in memory only if disabled)."""
        return PredictionCache(self.root / "predictions" if self.enabled else None)


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


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Run the whole experiment; returns the results and writes the report folder."""
    run = start_run(config)
    baselines = _train_baselines(run)
    base = baselines.singles[0]
    rankings = rank_heads(run, base)
    pruned = _build_pruned(run, base, rankings)
    methods = _methods(run, baselines, pruned)
    known = run.cache.predictions()
    preds, results, heads, temperatures = _evaluate_all(run, methods, known)
    curves = run.stage.run(
        "zero-shot pruning curves",
        lambda: _pruning_curves(base, {"Taylor": rankings.taylor, "CircAvg": rankings.circuit}, run, known),
    )
    timed = {m.cost_name: m.model for m in methods if m.cost_name}
    cost = run.stage.run("cost benchmark", lambda: cost_table(timed, run.bench.test[0], config, run.compute))
    meta = _report_meta(run, base, temperatures, pruned.member_heads)
    meta.update(_unstructured_meta(base, pruned))
    _write_report(run, methods, results, heads, preds, meta, cost, curves, rankings, pruned)
    return {"results": results, "cost": cost, "meta": {**meta, "wall_s": run.stage.elapsed}}


def run_seeds(config: DemoConfig, seeds: list[int]) -> dict[str, Any]:
    """The demo once per seed (reports in ``out_dir/seed-<s>``), then every method's main
    metrics as mean ± std over the seeds (``out_dir/seeds.md`` and ``seeds.json``): the seeds
    vary the data sample, every model's training seed and the members' heads."""
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs at least two distinct seeds, got {seeds}")
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
    present in every seed)."""
    common = [m for m in next(iter(per_seed.values())) if all(m in r for r in per_seed.values())]
    summary = {}
    for method in common:
        rows = [main_row(r[method]) for r in per_seed.values()]
        summary[method] = {
            k: [float(np.mean([r[k] for r in rows])), float(np.std([r[k] for r in rows], ddof=1)), len(rows)]
            for k in rows[0]
        }
    return summary


def start_run(config: DemoConfig) -> DemoRun:
    """Resolve the precisions, load the data and make its batches."""
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
    return DemoRun(config, task, bench, Cache(config.cache_dir, config.use_cache), stage, compute, evaluation)


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
    run: DemoRun, base: torch.nn.Module, name: str, heads: HeadSet, seed: int, trunk: int = 0
) -> torch.nn.Module:
    """``base`` pruned to ``heads`` and fine-tuned with the members' settings of ``seed`` (with
    ``trunk``: only the blocks after the first ``trunk``), cached."""
    settings = run.config.recipe.config(run.config.model_seed(seed), member=True)
    if trunk:  # the shared trunk stays as in the base: train only the later blocks
        settings = replace(settings, last_k_blocks=base.config.num_hidden_layers - trunk)
    key = model_key(run.bench, settings, base=run.base_settings, heads=heads.to_dict(), trunk=trunk)
    return run.cached_model(
        f"fine-tune {name}", "member", key, partial(_prune_and_fine_tune, run, base, heads, settings)
    )


def _train_baselines(run: DemoRun) -> Baselines:
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
    one_model.update(_packed_and_mimo(run, singles[0]))
    settings = head_ensemble_settings(config.recipe)
    heads = run.cached_model(
        f"train {config.members} heads on Single's backbone (Deep Ensemble (D))",
        "head-ensemble",
        model_key(bench, settings, base=run.base_settings, members=config.members),
        partial(train_heads, bench, settings, singles[0], config.members),
    )
    return Baselines(singles, loras, one_model, heads)


def _packed_and_mimo(run: DemoRun, base: torch.nn.Module) -> dict[str, torch.nn.Module]:
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
            "avg",
            config.circuit_budget,
            checkpoint=checkpoint,
            precision=compute,
        ).to_dict(),
    )
    return Rankings(torch.tensor(scores), HeadSet.from_dict(single), CircuitOrder.from_dict(order))


def _build_pruned(run: DemoRun, base: torch.nn.Module, rankings: Rankings) -> PrunedModels:
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
        )
        suffix = f" (trunk {trunk})" if trunk else ""
        return build_hydra(
            base,
            config=settings,
            ranking=ranking,
            make_member=lambda m, hs: member(f"{kind} member {m}{suffix}", hs, m, trunk),
        )

    singles = {
        "Taylor": member("Taylor (single pruned)", rankings.taylor_single, 0),
        "CircAvg": member("CircAvg (single pruned)", rankings.circuit.head_set(config.num_pruned), 0),
    }
    for name in UNSTRUCTURED:
        if getattr(config, name.lower()):
            singles[name] = _unstructured_member(run, base, singles["Taylor"], name)
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


def _unstructured_member(
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


def _unstructured_meta(base: torch.nn.Module, pruned: PrunedModels) -> dict[str, str]:
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


def _prune_and_fine_tune(
    run: DemoRun, base: torch.nn.Module, heads: HeadSet, settings: FineTuneConfig
) -> torch.nn.Module:
    """``base`` pruned to ``heads``, fine-tuned on the run's training batches (uncached)."""
    member = prune(base, heads)
    fine_tune(member, run.bench.train, None, settings, progress=True)
    return member


def _methods(run: DemoRun, baselines: Baselines, pruned: PrunedModels) -> list[Method]:
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
        Method(deep, DeepEnsemble(baselines.singles), full, cost_name="Deep Ensemble", reliability=True),
        Method(f"LoRA-Ensemble (M={config.members})", DeepEnsemble(baselines.loras), full),
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
    methods += [Method(name, hydra, pruned_avg, cost_name=name) for name, hydra in pruned.trunks.items()]
    return methods


def _evaluate_all(
    run: DemoRun, methods: list[Method], known: PredictionCache
) -> tuple[dict[str, MethodPredictions], dict[str, Any], dict[str, str], dict[str, Any]]:
    """Every method through the one evaluation path (`evaluation.run`): predictions, result rows
    (temperature-scaled rows after their method), each row's Heads label (its method's) and the
    fitted temperatures."""
    bench = run.bench
    data = EvalData(bench.test, bench.oods, bench.shifted, bench.val)
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
    return preds, results, heads, temperatures


def _report_meta(run: DemoRun, base, temperatures: dict[str, Any], member_heads) -> dict[str, str]:
    config, bench = run.config, run.bench
    heads_per_layer = heads_per_layer_of(base)
    evaluation = "" if run.evaluation == run.compute else f"; evaluation in {run.evaluation}"
    return {
        "command": config.command,
        "machine": describe_machine(),
        "precision": str(run.compute) + evaluation,
        "model": f"{config.model} ({type(base).__name__}, {len(heads_per_layer)} layers x "
        f"{heads_per_layer[0]} heads{', trained from scratch' if bench.from_scratch else ''})",
        **{f"data: {k}": v for k, v in run.task.describe().items()},
        "training recipe (all methods)": json.dumps(asdict(config.recipe)),
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
            f"{k}: {_mean_offdiag(member_overlap(v, heads_per_layer)):.2f}" for k, v in member_heads.items()
        ),
        "scaled down": "; ".join(config.scaled_down()),
        "wall time (s)": f"{run.stage.elapsed:.0f}",
    }


def _write_report(run: DemoRun, methods, results, heads, preds, meta, cost, curves, rankings, pruned) -> None:
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
        reporting.heads_map(sets, rankings.circuit.heads_per_layer, plots / f"heads_{kind}.png")
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
            f"{k} {v['latency_ms']:.0f} ms / {v['params'] / 1e6:.1f}M params / {v['gmacs']:.1f} GMAC"
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
    with torch.inference_mode():
        times = {
            k: median(v) for k, v in interleaved_latency(runs, repeats=config.bench_repeats, warmup=1).items()
        }
        macs = {k: multiply_adds(r) for k, r in runs.items()}
    params = {k: sum(count_parameters(x) for x in ms) for k, ms in members.items()}
    return {
        "batch": int(batch["labels"].shape[0]),
        "input": _describe_input(inputs),
        "precision": compute.name,
        "precision_reason": compute.reason,
        "methods": {
            k: {"latency_ms": 1e3 * times[k], "params": params[k], "gmacs": macs[k] / 1e9} for k in runs
        },
    }


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


def _pruning_curves(base, rankings: dict[str, Any], run: DemoRun, known: PredictionCache) -> PruningCurves:
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
            f"{row['latency_ms']:.0f}",
            f"{row['latency_ms'] / single['latency_ms']:.2f}",
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
