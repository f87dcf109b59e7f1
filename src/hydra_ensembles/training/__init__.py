"""Fine-tuning pruned members (paper Appendix D.2), through Hugging Face Accelerate.

Each member is fine-tuned independently on the same training data: selectable trainable parts
(attention, MLP, LayerNorms, classifier head, embeddings; optionally only the last k blocks),
AdamW or SGD with momentum, linear warm-up then cosine (or linear) decay, label smoothing,
early stopping on validation NLL, reduced-precision autocast where the hardware has it
(`precision.resolve_precision`), a checkpoint per epoch and resume. The same
code runs on CPU, one GPU, or many processes under ``accelerate launch``.

Checkpoints hold safetensors and JSON only (optimizer state included), written atomically.
"""

from .checkpoint import CheckpointError, has_checkpoint
from .config import (
    AUTO_EPOCHS_RANGE,
    AUTO_EPOCHS_STEPS,
    PARTS,
    FineTuneConfig,
    auto_epochs,
    trainable_parameters,
)
from .loop import TrainingDiverged, evaluate_nll, fine_tune
from .loss_scale import FP16_INITIAL_SCALE, FP16_RETRIES, LossScale
from .records import (
    FineTuneResult,
    describe_epoch,
    record_training,
    training_records,
    training_summary,
)

__all__ = [
    "AUTO_EPOCHS_RANGE",
    "AUTO_EPOCHS_STEPS",
    "FP16_INITIAL_SCALE",
    "FP16_RETRIES",
    "PARTS",
    "CheckpointError",
    "FineTuneConfig",
    "FineTuneResult",
    "LossScale",
    "TrainingDiverged",
    "auto_epochs",
    "describe_epoch",
    "evaluate_nll",
    "fine_tune",
    "has_checkpoint",
    "record_training",
    "trainable_parameters",
    "training_records",
    "training_summary",
]
