"""The demo's configuration: the training recipe every method shares, the presets per task and
model, `DemoConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra_ensembles.errors import InputError
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.members import sample_members
from hydra_ensembles.models import DEFAULT_TEXT_MODEL, SCRATCH_IMAGE_MODEL, SMALL_VITS
from hydra_ensembles.training import FineTuneConfig

from .pretrained import DEFAULT_IMAGE_MODEL


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
    trainable: tuple[str, ...] = ("attention", "mlp", "norm", "classifier")
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
    trainable=("attention", "mlp", "norm", "classifier", "embeddings"),
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
    flag_ood_items: int | None = 200
    """OOD validation items each method's flag score is chosen on (None: all of them)."""
    circuit_length: int = 16
    curve_step: int = 16
    """The training-free pruning curves measure every ``curve_step`` heads up to the pool size."""
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
    keep_base: bool = False
    """Each Hydra's member 0 is the fine-tuned base model itself (Single), unpruned and not trained
    again, beside M - 1 pruned members (`BuildConfig.keep_base`): the single model inside the
    ensemble, a member-diversity study."""
    bagging: bool = False
    """Each pruned member fine-tunes on its own bootstrap resample of the training data (bagging,
    `BuildConfig.bootstrap`): a member-diversity study; the other methods train as always."""
    mlp_keep: float = 1.0
    """The share of each layer's MLP neurons every Hydra member keeps (`BuildConfig.mlp_keep`: the
    same neurons for every member, pruned before the heads and recovered by the members'
    fine-tuning): a cost study; the single pruned models keep their whole MLP."""
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
    """Also report the paper's unstructured baseline, OBA (`baselines.unstructured`): the weights
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
        """The default (minutes on a 2-core CPU) or ``full`` protocol of a task.

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
            raise InputError(f"unknown task {task!r}; choose from {list(TASKS)}")
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
        notes.append(f"training-free pruning curves every {self.curve_step} heads")
        return notes
