"""The baselines' training recipes and trainers (Single, LoRA-Ensemble, BatchEnsemble,
Packed-Ensembles, MIMO, Deep Ensemble (D) heads)."""

from __future__ import annotations

from dataclasses import replace

import torch

from hydra_ensembles.baselines import head_ensemble, train_head_ensemble
from hydra_ensembles.baselines.batch_ensemble import batch_ensemble
from hydra_ensembles.baselines.lora import lora_fine_tune
from hydra_ensembles.baselines.mimo import mimo, train_mimo
from hydra_ensembles.baselines.packed import packed_ensemble
from hydra_ensembles.evaluation import (
    predict,
)
from hydra_ensembles.metrics import classification
from hydra_ensembles.training import FineTuneConfig, fine_tune

from .cache import Cache
from .config import IMAGE_RECIPE, DemoConfig, TrainingRecipe
from .data import Benchmark, load_demo_task, model_key, prepare_benchmark


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
    usual step (not tuned here): one epoch at the backbone's fine-tuning step under-fits fresh
    heads (docs/design-notes.md)."""
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
