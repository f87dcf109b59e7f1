"""Temperature scaling fit by NLL on validation data (LBFGS), for single models and ensembles.

``per_member=False`` fits one temperature shared by all members (the ensemble's softmaxes are
averaged after dividing every member's logits by it); ``per_member=True`` fits one per member,
each on that member's own NLL.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..outputs import ensemble_nll
from .predict import Predictions

MIN_CALIBRATION_SIZE = 50
"""Below this many validation inputs a fitted temperature is mostly noise (a warning says so)."""


def _fit(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The temperature minimising the NLL of the mean softmax of ``logits`` (M, N, C)."""
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    # one variable: the newest curvature pair sets each step (older pairs add only rounding), so a
    # short history gives the same temperature as LBFGS's default of 100 pairs at half the cost
    optimizer = torch.optim.LBFGS(
        [log_t], lr=0.1, max_iter=200, history_size=10, line_search_fn="strong_wolfe"
    )

    def nll() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ensemble_nll(logits / log_t.exp(), labels)
        loss.backward()
        return loss

    optimizer.step(nll)
    return float(log_t.exp().item())


def check_temperature_data(labels: Any, logits: Any = None, classes: Sequence[str] | None = None) -> None:
    """Refuse labelled validation data no temperature can be fit on: inputs of fewer than two
    classes (with every input of one class the NLL falls without bound as the temperature moves
    towards 0 or infinity, so the fit runs away: a temperature of millions that makes every
    probability 1/C), and, where given, ``logits`` holding NaN or Inf. ``classes``: the class
    names, to name the one present."""
    present = np.unique(np.asarray(labels, dtype=np.int64))
    if len(present) < 2:
        only = "none" if not len(present) else repr(_class_name(int(present[0]), classes))
        raise InputError(
            f"the labelled validation inputs that fit the temperature are of one class ({only}): a "
            "temperature (and the calibration) needs inputs of at least two classes (with prediction "
            "sets, among every second input): give validation data of every class"
        )
    if logits is not None:
        check_finite_logits(logits)


def check_finite_logits(logits: Any) -> None:
    """InputError naming the first validation input (its index in ``logits``, members x inputs x
    ...) and member whose logits hold NaN or Inf."""
    bad = ~np.isfinite(np.asarray(logits, dtype=np.float64)).reshape(*np.shape(logits)[:2], -1).all(-1)
    if bad.any():
        member, row = (int(i[0]) for i in np.nonzero(bad))
        raise InputError(
            f"the model's logits are NaN or Inf on validation input {row} (member {member}): "
            "nothing can be calibrated on them; check the model's weights and that input"
        )


def _class_name(index: int, classes: Sequence[str] | None) -> str:
    return classes[index] if classes is not None and 0 <= index < len(classes) else str(index)


def fit_temperature(predictions: Predictions, per_member: bool = False) -> float | np.ndarray:
    """The temperature(s) minimising validation NLL of ``predictions`` (which need labels of at
    least two classes: `check_temperature_data`)."""
    labels = torch.as_tensor(predictions.class_labels("temperature scaling's labelled validation data"))
    check_temperature_data(labels.numpy(), predictions.member_logits)
    logits = torch.as_tensor(predictions.member_logits, dtype=torch.float64)
    if len(labels) < MIN_CALIBRATION_SIZE:
        warnings.warn(
            f"temperature fit on only {len(labels)} validation inputs (fewer than {MIN_CALIBRATION_SIZE}): "
            "expect a noisy temperature",
            stacklevel=2,
        )
    if per_member:
        return np.array([_checked(logits[m : m + 1], labels) for m in range(logits.shape[0])])
    return _checked(logits, labels)


def _checked(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The fitted temperature, or 1 where the data cannot set one: when no validation input is
    wrong with every member agreeing (a single model without validation errors, an ensemble whose
    every error has a dissenting member), the NLL's limit as T -> 0 (one-hot votes) is finite and
    may lie below every finite temperature's, so the fit runs towards 0 and would make every
    prediction certain, confidently wrong on the first unanimous error."""
    temperature = _fit(logits, labels)
    votes = (logits.argmax(-1) == labels[None]).double().mean(0)  # members right, per input
    if bool((votes == 0).any()):
        return temperature
    limit = float(-votes.log().mean())
    with torch.no_grad():
        fitted = float(ensemble_nll(logits / temperature, labels))
    if limit > fitted + 1e-9:
        return temperature
    warnings.warn(
        f"the validation NLL keeps falling as the temperature goes to 0 (fit: {temperature:.2g}): no "
        "validation input is wrong with every member agreeing, so the data cannot set a temperature; "
        "temperature 1 is kept (fit on more validation data)",
        stacklevel=3,
    )
    return 1.0


def split_for_sets(id_validation: Predictions) -> tuple[Predictions, Predictions]:
    """The validation predictions split by position: the even inputs (0, 2, ...) fit the
    temperature, the odd ones calibrate the prediction sets at that temperature. Kept apart,
    the sets' coverage guarantee does not depend on the temperature's fit."""
    labels = id_validation.class_labels("prediction sets' labelled validation data")
    features, layers = id_validation.member_features, id_validation.layer_features

    def part(start: int) -> Predictions:
        rows = slice(start, None, 2)
        return Predictions(
            id_validation.member_logits[:, rows],
            labels[rows],
            None if features is None else features[:, rows],
            None if layers is None else layers[:, rows],
        )

    return part(0), part(1)
