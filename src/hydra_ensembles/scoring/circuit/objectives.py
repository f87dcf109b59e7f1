"""The objective S a removal keeps (accuracy, MSP AUROC or their mean), its tie-break companion,
and the range of S that logits within a rounding error can reach."""

from __future__ import annotations

import math

import numpy as np
import torch

from ...metrics import auroc


def objective_value(
    objective: str, id_logits: torch.Tensor, id_labels: torch.Tensor, ood_logits: torch.Tensor | None
) -> float:
    """S for one set of logits: accuracy, MSP AUROC (OOD positive), or their mean."""
    acc = (id_logits.argmax(-1) == id_labels).double().mean().item()
    if objective == "acc":
        return acc
    msp_id = 1.0 - id_logits.double().softmax(-1).max(-1).values
    msp_ood = 1.0 - ood_logits.double().softmax(-1).max(-1).values
    separation = auroc(msp_id.cpu().numpy(), msp_ood.cpu().numpy())  # logits may be on a GPU
    return separation if objective == "ood" else 0.5 * (acc + separation)


def tie_break_value(
    objective: str, id_logits: torch.Tensor, id_labels: torch.Tensor, ood_logits: torch.Tensor | None
) -> float:
    """A continuous companion of S, used only to order candidates whose S ties.

    Accuracy and AUROC saturate on small or easy validation sets (many candidates reach S = 1),
    and the plain algorithm would then remove heads in index order. Ties are broken by the ID
    log-likelihood (``acc``), the ID-minus-OOD mean confidence gap (``ood``), or their sum
    (``avg``), rounded to 6 decimals so float noise cannot reorder candidates.
    """
    log_probs = id_logits.double().log_softmax(-1)
    likelihood = log_probs.gather(-1, id_labels[:, None]).mean().item()
    if objective == "acc":
        return round(likelihood, 6)
    gap = (
        id_logits.double().softmax(-1).max(-1).values.mean()
        - ood_logits.double().softmax(-1).max(-1).values.mean()
    ).item()
    return round(gap if objective == "ood" else likelihood + gap, 6)


def objective_scores(objective, id_logits, id_labels, ood_logits) -> tuple[float, float]:
    return (
        objective_value(objective, id_logits, id_labels, ood_logits),
        tie_break_value(objective, id_logits, id_labels, ood_logits),
    )


def objective_bounds(
    objective: str,
    id_logits: torch.Tensor,
    id_labels: torch.Tensor,
    ood_logits: torch.Tensor | None,
    error: float,
) -> tuple[float, float]:
    """The lowest and highest S that logits within ``error`` (each entry) of ``id_logits`` and
    ``ood_logits`` can have: how far a low-precision evaluation can be from the exact one.

    Accuracy: an example whose label logit leads every other by more than ``2 * error`` is
    correct either way, one that trails by more is wrong either way; the rest can go both ways.
    AUROC: a logit error of ``error`` moves every ``logit_j - max logit`` by at most ``2 * error``,
    so the maximum softmax probability p lies in ``[p e^(-2 error), p e^(2 error)]``; AUROC only
    falls as ID scores rise and OOD scores fall, so its bounds are the AUROCs of the extremes.
    """
    x = id_logits.double()
    label = x.gather(-1, id_labels[:, None])[:, 0]
    others = x.scatter(-1, id_labels[:, None], -math.inf).max(-1).values
    lead = label - others
    acc = ((lead > 2 * error).double().mean().item(), (lead >= -2 * error).double().mean().item())
    if objective == "acc":
        return acc

    def msp_range(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        p = logits.double().softmax(-1).max(-1).values
        low, high = p * math.exp(-2 * error), (p * math.exp(2 * error)).clamp(max=1.0)
        return (1.0 - high).cpu().numpy(), (1.0 - low).cpu().numpy()  # the OOD score 1 - p: low, high

    id_low, id_high = msp_range(id_logits)
    ood_low, ood_high = msp_range(ood_logits)
    separation = (auroc(id_high, ood_low), auroc(id_low, ood_high))
    if objective == "ood":
        return separation
    return 0.5 * (acc[0] + separation[0]), 0.5 * (acc[1] + separation[1])
