"""The demo's data as model-input batches (`Benchmark`), and the cache key of a trained model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hydra_ensembles.batching import model_inputs
from hydra_ensembles.data import to_batches
from hydra_ensembles.hashing import text_digest
from hydra_ensembles.models import (
    SMALL_VITS,
    load_classifier,
    load_image_processor,
    load_tokenizer,
    small_vit,
)
from hydra_ensembles.training import FineTuneConfig

from .config import DemoConfig
from .tasks import Dataset, Task, load_image_task, load_text_task


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
    ood_val: list[dict]
    """The whole OOD validation set (unlabelled), at the evaluation's length: chooses each
    method's flag score (never an OOD test set)."""
    initial: Callable[[int], torch.nn.Module]
    """seed -> the model before training: pretrained weights with a new head, or random."""
    from_scratch: bool
    key: dict[str, Any]
    """What the data and the starting model are (cache keys hash it)."""
    preprocessor: Any = None
    """The tokenizer or image processor the batches were made with (None: raw pixels)."""

    def batches(self, data: Dataset, length: int, batch_size: int = 64) -> list[dict]:
        """More batches made like the benchmark's (texts cut to ``length`` tokens)."""
        return list(to_batches(data, self.preprocessor, batch_size, length))


def _data_key(dataset: Dataset) -> str:
    return text_digest("\n".join(dataset.ids))[:16]


def prepare_benchmark(config: DemoConfig, task: Task) -> Benchmark:
    """Batches for every split, OOD set, shifted set and the circuit-extraction data."""
    classes = len(task.classes)
    from_scratch = config.model in SMALL_VITS
    if config.task == "image":  # the pretrained model's image processor; none from scratch
        preprocessor = None if from_scratch else load_image_processor(config.model)
    else:
        preprocessor = load_tokenizer(config.model)

    def batched(
        data: Dataset, batch_size: int = config.eval_batch_size, length: int = config.max_length
    ) -> list[dict]:  # images ignore the length
        return list(to_batches(data, preprocessor, batch_size, length))

    def initial(seed: int) -> torch.nn.Module:
        if from_scratch:
            return small_vit(config.model, num_labels=classes, seed=seed)
        return load_classifier(config.model, num_labels=classes, seed=seed)

    def head(data: Dataset, count: int) -> Dataset:
        return data.subset(range(min(count, len(data))))

    return Benchmark(
        task=task,
        train=batched(task.train, config.recipe.batch_size),
        val=batched(task.val),
        test=batched(task.test),
        oods={name: (kind, batched(data)) for name, (kind, data) in task.ood_test.items()},
        shifted={key: batched(data) for key, data in task.shift.items()},
        circuit_id=batched(head(task.val, config.circuit_id_items), 64, config.circuit_length),
        circuit_ood=[
            model_inputs(b)
            for b in batched(head(task.ood_val, config.circuit_ood_items), 64, config.circuit_length)
        ],
        ood_val=[
            model_inputs(b) for b in batched(head(task.ood_val, config.flag_ood_items or len(task.ood_val)))
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
