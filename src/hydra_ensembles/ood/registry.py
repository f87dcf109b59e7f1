"""The registry of feature-space OOD scores: one class per score, one registration each.

A feature score is fit per member on that member's labelled ID training features (float64) and
scores each member's features; the ensemble's score is the mean over the members. A score is a
`FeatureScore` subclass that names itself, says what it fits (`FeatureScore.fit`: named arrays,
saved with the model's statistics) and how it scores (`FeatureScore.score`, in torch, so the
exported graph computes it too), registered with `register_feature_score`:

    @register_feature_score
    class Norm(FeatureScore):
        name = "norm"

        def fit(self, x, y, classes, context):
            return {"norm.mean": np.linalg.norm(x, axis=-1).mean(keepdims=True)}

        def score(self, f, tensors, context):
            return torch.linalg.vector_norm(f, dim=-1) - tensors["norm.mean"]

`FeatureStatistics` fits and scores every registered score by name; `feature_scores()` lists
them in the order they were registered (the built-in ones: `scores/`).

A score fit *in passes* over blocks of rows instead (``passes`` > 0: `FeatureScore.summarise`,
`merge` and `finish`, run by `ood.passes`) is fit the same way in one process (one block) and
over data split across processes (`hydra_ensembles.distributed`): each pass summarises every
block (sums, or rows to keep), the summaries are merged in any order, and what they determine is
fit before the next pass reads it. The built-in feature scores are all fit so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import InputError

__all__ = [
    "Block",
    "FeatureScore",
    "FitContext",
    "LogitScore",
    "LogitView",
    "PassContext",
    "ScoreContext",
    "feature_score",
    "feature_scores",
    "logit_score",
    "logit_scores",
    "reads_layers",
    "register_feature_score",
    "register_logit_score",
]


@dataclass(frozen=True)
class FitContext:
    """What a score's fit may read beside one member's features and labels: the member's output
    layer ``head`` = (W (C, D), b (C,)) where it was given (None otherwise), the rows of the
    training features kept as a bank (`FeatureStatistics.fit`'s ``bank_size``), the fit's
    settings (``knn_k``, ``vim_dim``, ...), and the member's pooled token after every
    transformer layer ``layers`` (N, L, D_h) where they were given."""

    head: tuple[np.ndarray, np.ndarray] | None
    bank_rows: np.ndarray
    settings: Mapping[str, Any] = field(default_factory=dict)
    layers: np.ndarray | None = None


@dataclass(frozen=True)
class Block:
    """One block of the training rows, every member's, float64: features ``(M, n, D)``, class ids
    ``labels`` (n,), each row's place among all training rows ``index`` (n,; the order
    `FeatureStatistics.fit` reads them in) and the pooled token after every layer ``layers``
    ``(M, n, L, D_h)`` where they are fit (else None)."""

    features: np.ndarray
    labels: np.ndarray
    index: np.ndarray
    layers: np.ndarray | None = None


@dataclass(frozen=True)
class PassContext:
    """What a pass may read beside a block: the fit's settings (``examples``, ``knn_k``,
    ``vim_dim``, ...), every member's output layer ``heads`` = (W (M, C, D), b (M, C)) where given,
    the rows kept as the kNN bank ``bank_rows`` (places among all rows), the rows of each class
    ``class_counts`` (C,), and ``fitted``: every array the earlier passes fit (leading member axis)."""

    settings: Mapping[str, Any]
    heads: tuple[np.ndarray, np.ndarray] | None
    bank_rows: np.ndarray
    class_counts: np.ndarray
    fitted: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def present(self) -> np.ndarray:
        """The classes with training rows (sorted): the rows of the fitted class means."""
        return np.flatnonzero(self.class_counts > 0)

    def class_slots(self, labels: np.ndarray) -> np.ndarray:
        """Each class id's row among the fitted class means (`present`)."""
        return (np.cumsum(self.class_counts > 0) - 1)[labels]


@dataclass(frozen=True)
class ScoreContext:
    """What a score may read beside the members' features: the statistics' settings, the
    members' logits (M, N, C) at temperature 1 and their pooled tokens after every layer
    ``layer_features`` (M, N, L, D_h), float64 (each None where not given)."""

    settings: Mapping[str, Any]
    member_logits: torch.Tensor | None = None
    layer_features: torch.Tensor | None = None


class FeatureScore:
    """One feature-space OOD score (higher = more likely OOD). ``name`` names it (its fitted
    arrays' names start with ``name + "."``); ``reads``: other scores whose fitted arrays it reads
    too (fit with it); ``needs_head``: it is fit only where the members' output layers are given;
    ``needs_layers``: it reads every layer's pooled token (`FitContext.layers`,
    `ScoreContext.layer_features`) and is fit only where they are given; ``ensemble_only``: it
    measures the members' disagreement, so it is fit only for two members or more (what it fits
    across the members: `fit_ensemble`). ``passes``: the passes over blocks of rows its fit takes
    (`summarise`, `merge`, `finish`; such a score is fit in one process or across many alike); 0:
    it is fit by `fit` and `fit_ensemble`, in one process only."""

    name: ClassVar[str]
    reads: ClassVar[tuple[str, ...]] = ()
    needs_head: ClassVar[bool] = False
    needs_layers: ClassVar[bool] = False
    ensemble_only: ClassVar[bool] = False
    passes: ClassVar[int] = 0

    def can_fit(self, examples: int, width: int) -> bool:
        """Whether ``examples`` training features of ``width`` are enough to fit this score."""
        return True

    def fit(self, x: np.ndarray, y: np.ndarray, classes: int, context: FitContext) -> dict[str, np.ndarray]:
        """The arrays this score reads, fit on one member's training features ``x`` (N, D) with
        class ids ``y`` (N,), float64."""
        raise NotImplementedError

    def fit_ensemble(
        self, f: torch.Tensor, tensors: Mapping[str, torch.Tensor], context: ScoreContext
    ) -> dict[str, np.ndarray]:
        """Arrays fit across the members, after every member's `fit`: from all members' training
        features ``f`` (M, N, D), float64, the arrays fit so far and the training inputs' context;
        each returned array has a leading member axis (M, ...), like those `fit` returns. None by
        default."""
        return {}

    def summarise(self, step: int, block: Block, context: PassContext) -> dict[str, np.ndarray]:
        """Pass ``step``'s summary of one block of rows (float64 arrays), read after the earlier
        passes fit ``context.fitted``."""
        raise NotImplementedError

    def merge(self, step: int, summaries: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Pass ``step``'s summaries of every block in one, in any order: their sums by default."""
        return add(summaries)

    def finish(
        self, step: int, summary: Mapping[str, np.ndarray], context: PassContext
    ) -> dict[str, np.ndarray]:
        """The arrays pass ``step`` fits from the merged ``summary`` (leading member axis; the
        later passes read them in ``context.fitted``, and they are saved)."""
        raise NotImplementedError

    def score(
        self, f: torch.Tensor, tensors: Mapping[str, torch.Tensor], context: ScoreContext
    ) -> torch.Tensor:
        """Each member's score (M, N), float64, from features ``f`` (M, N, D) and the fitted arrays
        ``tensors`` (each with a leading member axis)."""
        raise NotImplementedError


def add(summaries: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The sums of several blocks' summaries, in any order (`FeatureScore.merge`'s default)."""
    total: dict[str, np.ndarray] = {}
    for summary in summaries:
        for key, value in summary.items():
            total[key] = total[key] + value if key in total else np.asarray(value, np.float64).copy()
    return total


_REGISTRY: dict[str, FeatureScore] = {}


def register_feature_score(cls: type[FeatureScore]) -> type[FeatureScore]:
    """Register the score ``cls`` under ``cls.name`` (a class decorator); a name taken by another
    class is refused."""
    _register(_REGISTRY, cls, "feature score")
    return cls


def feature_scores() -> tuple[str, ...]:
    """Every registered feature score, in the order of registration."""
    return tuple(_REGISTRY)


def reads_layers(name: str) -> bool:
    """Whether the OOD score ``name`` reads every layer's features (`FeatureScore.needs_layers`;
    False for a logit score or an unknown name)."""
    return name in _REGISTRY and _REGISTRY[name].needs_layers


def feature_score(name: str) -> FeatureScore:
    """The registered score ``name``; InputError naming the registered ones otherwise."""
    return _registered(_REGISTRY, name, "feature score")


@dataclass(frozen=True)
class LogitView:
    """What a logit score reads: the members' logits (M, N, C) and their softmax probabilities at
    the calibration's temperature (M, N, C)."""

    member_logits: np.ndarray
    member_probs: np.ndarray

    @property
    def probs(self) -> np.ndarray:
        """The ensemble's probabilities (N, C): the mean of the members' (never of their logits)."""
        return self.member_probs.mean(0)

    @property
    def mean_logits(self) -> np.ndarray:
        """The members' mean logits (N, C)."""
        return self.member_logits.mean(0)


class LogitScore:
    """One OOD score of an ensemble's logits or probabilities (higher = more likely OOD), needing
    nothing fit: ``name`` names it; `score` computes it (float64 numpy, (N,)); ``ensemble_only``:
    it measures the members' disagreement, so a single model has none. The built-in ones are
    `scores/msp.py` and its neighbours; register a new one with `register_logit_score`."""

    name: ClassVar[str]
    ensemble_only: ClassVar[bool] = False

    def score(self, view: LogitView) -> np.ndarray:
        raise NotImplementedError


_LOGIT_REGISTRY: dict[str, LogitScore] = {}


def register_logit_score(cls: type[LogitScore]) -> type[LogitScore]:
    """Register the logit score ``cls`` under ``cls.name`` (a class decorator); a name taken by
    another class, of either kind of score, is refused."""
    _register(_LOGIT_REGISTRY, cls, "logit score")
    return cls


def logit_scores() -> tuple[str, ...]:
    """Every registered logit score, in the order of registration."""
    return tuple(_LOGIT_REGISTRY)


def logit_score(name: str) -> LogitScore:
    """The registered logit score ``name``; InputError naming the registered ones otherwise."""
    return _registered(_LOGIT_REGISTRY, name, "logit score")


def _registered(registry: dict[str, Any], name: str, kind: str) -> Any:
    if name not in registry:
        raise InputError(f"unknown {kind} {name!r}; choose from {tuple(registry)}")
    return registry[name]


def _register(registry: dict[str, Any], cls: type, kind: str) -> None:
    """``cls`` (its instance) under its ``name`` in ``registry``: one namespace for both kinds of
    score, so that a name means one score wherever it is written."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or "." in name:
        raise InputError(f"a {kind} needs a name without dots, got {name!r}")
    for other in (_REGISTRY, _LOGIT_REGISTRY):
        if name in other and type(other[name]) is not cls:
            raise InputError(f"the score {name!r} is registered already ({type(other[name]).__name__})")
    registry[name] = cls()
