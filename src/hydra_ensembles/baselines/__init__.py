"""The baselines Hydra is compared with, each built from the same pretrained model: BatchEnsemble,
Deep Ensembles (D) heads, LoRA-Ensemble members, MIMO, Packed-Ensembles and unstructured pruning
(OBA, Wanda). Saved and loaded with `members.save_member` / `load_member`; run as ensembles by
`members.as_ensemble`."""

from .batch_ensemble import batch_ensemble, batch_ensemble_members
from .head_ensemble import head_ensemble, head_ensemble_members, train_head_ensemble
from .lora import lora_fine_tune
from .mimo import mimo, mimo_members, train_mimo
from .packed import packed_ensemble, packed_member, packed_members
from .unstructured import make_permanent, matched_sparsity, oba_masks, unstructured_prune, wanda_masks

__all__ = [
    "batch_ensemble",
    "batch_ensemble_members",
    "head_ensemble",
    "head_ensemble_members",
    "lora_fine_tune",
    "make_permanent",
    "matched_sparsity",
    "mimo",
    "mimo_members",
    "oba_masks",
    "packed_ensemble",
    "packed_member",
    "packed_members",
    "train_head_ensemble",
    "train_mimo",
    "unstructured_prune",
    "wanda_masks",
]
