"""Building members: diverse head sets from a ranking, fine-tuning, saving and loading."""

from .finetune import FineTuneConfig, FineTuneResult, evaluate_nll, fine_tune, trainable_parameters
from .sampling import least_useful_first, member_overlap, sample_members
from .storage import load_member, save_member

__all__ = [
    "FineTuneConfig",
    "FineTuneResult",
    "evaluate_nll",
    "fine_tune",
    "least_useful_first",
    "load_member",
    "member_overlap",
    "sample_members",
    "save_member",
    "trainable_parameters",
]
