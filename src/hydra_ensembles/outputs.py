"""The one output contract of every ensemble in the library, and its one NLL.

Deep ensembles, MC dropout, BatchEnsemble, LoRA-Ensembles and fused Hydra models all answer a
forward call with an `EnsembleOutput`: member logits (M, B, C) and the ensemble prediction, the
mean of the members' softmaxes (never of their logits). A single model is an ensemble of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class EnsembleOutput:
    """Outputs of an ensemble.

    ``member_logits`` is (M, B, C); ``probs`` is the ensemble prediction (B, C): the mean of the
    members' softmax probabilities. ``member_features`` (M, B, D) is what each member's output
    layer read (`ood.features`; None for a model whose logits are not one affine map of one
    feature vector). ``members`` holds every batch-shaped output of an underlying Hugging Face
    model, reshaped to (M, B, ...). ``loss`` is the ensemble's NLL (`ensemble_nll`) when
    ``labels`` were given. ``layer_features`` (M, B, L, D_h): each member's pooled token after
    every transformer layer, where the ensemble was asked to record them (``record_layers``).
    """

    member_logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    members: dict[str, torch.Tensor] = field(default_factory=dict)
    member_features: torch.Tensor | None = None
    layer_features: torch.Tensor | None = None

    @property
    def member_probs(self) -> torch.Tensor | None:
        return None if self.member_logits is None else self.member_logits.float().softmax(-1)

    @property
    def num_members(self) -> int:
        return 0 if self.member_logits is None else int(self.member_logits.shape[0])

    @classmethod
    def from_member_logits(
        cls,
        member_logits: torch.Tensor,
        labels: torch.Tensor | None = None,
        member_features: torch.Tensor | None = None,
        layer_features: torch.Tensor | None = None,
        **members: torch.Tensor,
    ) -> EnsembleOutput:
        """The output of members whose logits are ``member_logits`` (M, B, C), whose output
        layers read ``member_features`` (M, B, D), and whose layers' pooled tokens are
        ``layer_features`` (M, B, L, D_h)."""
        probs = member_logits.float().softmax(-1).mean(0)
        loss = None if labels is None else ensemble_nll(member_logits, labels.to(member_logits.device))
        return cls(member_logits, probs, loss, members, member_features, layer_features)


def ensemble_log_probs(member_logits: torch.Tensor) -> torch.Tensor:
    """log of the mean member softmax (B, C) from member logits (M, B, C), computed stably as
    ``logsumexp_m log_softmax(logits_m) - log M`` (no clamping of tiny probabilities)."""
    dtype = torch.float64 if member_logits.dtype == torch.float64 else torch.float32
    log_probs = member_logits.to(dtype).log_softmax(-1)
    return torch.logsumexp(log_probs, 0) - math.log(member_logits.shape[0])


def ensemble_nll(member_logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Negative log-likelihood of ``labels`` under the mean of member softmaxes: the loss of an
    ensemble (training selection, temperature scaling and `EnsembleOutput.loss` all use it)."""
    return F.nll_loss(ensemble_log_probs(member_logits), labels, reduction=reduction)
