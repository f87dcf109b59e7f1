"""Building members: diverse head sets from a ranking, fine-tuning, saving and loading."""

from .batch_ensemble import batch_ensemble, batch_ensemble_members
from .ensemble import DeepEnsemble, MCDropout, StackedMembers, as_ensemble
from .finetune import (
    CheckpointError,
    FineTuneConfig,
    FineTuneResult,
    TrainingDiverged,
    evaluate_nll,
    fine_tune,
    trainable_parameters,
)
from .head_ensemble import head_ensemble, head_ensemble_members, train_head_ensemble
from .lora import lora_fine_tune
from .mimo import mimo, mimo_members, train_mimo
from .packed import packed_ensemble, packed_member, packed_members
from .sampling import least_useful_first, member_overlap, sample_members
from .storage import AutoMember, MemberLoadError, load_member, save_member

__all__ = [
    "AutoMember",
    "CheckpointError",
    "DeepEnsemble",
    "FineTuneConfig",
    "FineTuneResult",
    "MCDropout",
    "MemberLoadError",
    "StackedMembers",
    "TrainingDiverged",
    "as_ensemble",
    "batch_ensemble",
    "batch_ensemble_members",
    "evaluate_nll",
    "fine_tune",
    "head_ensemble",
    "head_ensemble_members",
    "least_useful_first",
    "load_member",
    "lora_fine_tune",
    "member_overlap",
    "mimo",
    "mimo_members",
    "packed_ensemble",
    "packed_member",
    "packed_members",
    "sample_members",
    "save_member",
    "train_head_ensemble",
    "train_mimo",
    "trainable_parameters",
]
