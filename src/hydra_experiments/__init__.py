"""The applications built on `hydra_ensembles`: the paper's experiments on embedded benchmarks
(``hydra-ens demo``, `demo` and `zero_shot`), its analysis (``hydra-ens analyze``, `analyze`) and
the cost benchmark (``hydra-ens bench``, `bench`), each a thin driver over the stages here.

The demo: text (default): MiniLM-L6 fine-tuned on BBC News; image: DINOv2-S/14 (pretrained, converted from
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

from .cache import Cache, PredictionCache, Stage
from .config import IMAGE_RECIPE, PRESETS, PRETRAINED_IMAGE_RECIPE, TASKS, DemoConfig, TrainingRecipe
from .data import Benchmark, load_demo_task, model_key, prepare_benchmark
from .demo import run_demo, run_seeds, seed_summary
from .recipes import (
    batch_ensemble_settings,
    demo_starting_point,
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
    validation_scores,
)
from .report import cost_table, evaluate_all, pruning_curves, report_meta, write_report
from .stages import UNSTRUCTURED, pruned_member, rank_heads, rank_model, start_run, trained_single
from .state import Baselines, DemoRun, Method, PrunedModels, PruningCurves, Rankings

__all__ = [
    "IMAGE_RECIPE",
    "PRESETS",
    "PRETRAINED_IMAGE_RECIPE",
    "TASKS",
    "UNSTRUCTURED",
    "Baselines",
    "Benchmark",
    "Cache",
    "DemoConfig",
    "DemoRun",
    "Method",
    "PredictionCache",
    "PrunedModels",
    "PruningCurves",
    "Rankings",
    "Stage",
    "TrainingRecipe",
    "batch_ensemble_settings",
    "cost_table",
    "demo_starting_point",
    "evaluate_all",
    "head_ensemble_settings",
    "load_demo_task",
    "lora_settings",
    "mimo_settings",
    "model_key",
    "packed_settings",
    "prepare_benchmark",
    "pruned_member",
    "pruning_curves",
    "rank_heads",
    "rank_model",
    "report_meta",
    "run_demo",
    "run_seeds",
    "seed_summary",
    "start_run",
    "train_batch_ensemble",
    "train_heads",
    "train_lora",
    "train_mimo_model",
    "train_model",
    "train_packed",
    "trained_single",
    "validation_scores",
    "write_report",
]
