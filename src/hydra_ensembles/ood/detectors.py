"""Feature-space OOD scores, fit on labelled ID training features, for each member of an ensemble.

Every score is "higher = more likely OOD" and is computed per member on that member's own
features (`ood.features`); the ensemble's score is the **mean of its members' scores** (and the
members' spread is their standard deviation). All statistics are fit and every score computed in
float64, whatever precision the model ran in. Each score is one registered class
(`ood.registry`; the built-in ones in `ood/scores/`, one module each):

- ``mds``: Mahalanobis distance to the closest class mean under one covariance shared by the
  classes (Lee et al., 2018), ``min_c (f - mu_c)^T P (f - mu_c)``.
- ``rmds``: relative Mahalanobis (Ren et al., 2021): the class distance minus the distance to the
  mean of all training features under their own covariance, ``min_c d_c(f) - d_0(f)``.
- ``mds++``: ``mds`` on L2-normalised features (Mueller and Hein, 2025, "Mahalanobis++").
- ``knn``: the Euclidean distance of the normalised feature to its k-th nearest normalised
  training feature (Sun et al., 2022; k = 50, or the bank's size if smaller).
- ``vim``: virtual-logit matching (Wang et al., 2022), from the members' output layers.
- ``mds_layers``: ``mds`` on every transformer layer's pooled token, each layer's score
  standardised on the ID training data and averaged over the layers; fit where the members'
  layer features are given (`FeatureStatistics.fit`'s ``layer_features``).
- ``mds_disagreement``: ``mds_layers`` plus the members' spread of each layer's standardised
  distance, each standardised on the ID training data (ensembles of two members or more; fit
  across the members).

The covariances are Ledoit-Wolf shrinkage estimates (the shrinkage is close to 0 where examples
far outnumber dimensions, and keeps the matrix invertible where they do not: few examples, wide
features, features rounded to bf16); a covariance with no spread at all (every feature equal to
its class mean) has no inverse, and its pseudo-inverse (zero) is used. What is stored, per member:
class means (C x D) and one precision matrix (D x D) for each of mds, mds++ and rmds's background,
the kNN bank (at most ``bank_size`` normalised training features, N x D) and ViM's origin and
residual basis (D x (D - k)): about ``(4 D + 2 C + N) D`` float64 numbers per member; with
``mds_layers``, also a precision matrix and class means per layer (about ``L (D_h + C) D_h``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..inputs import class_ids
from . import scores as _builtin_scores  # noqa: F401  (registers the built-in scores)
from .geometry import vim_dimension
from .passes import fit_in_passes
from .registry import (
    Block,
    FitContext,
    PassContext,
    ScoreContext,
    feature_score,
    feature_scores,
    reads_layers,
)

KNN_K = 50
"""Neighbours of the kNN score (OpenOOD's setting; capped at the bank's size)."""
BANK_SIZE = 10_000
"""At most this many training features per member are kept for kNN (a seeded random subset)."""
SCORE_ROWS = 64
"""Inputs each feature score computes at once, the last part filled with zero rows: a matrix
product's rounding depends on its shape, so an input's score is then the same number in any batch
and at any place in it (an input that is also a calibration input gets the same score and p-value
whether it is scored alone, in a file, or by a Ray worker's batch)."""
STATISTICS_NAME = "ood_statistics.safetensors"
FORMAT = "hydra-ensembles/ood-statistics"

__all__ = [
    "BANK_SIZE",
    "KNN_K",
    "STATISTICS_NAME",
    "FeatureStatistics",
    "bank_rows",
    "fit_plan",
    "vim_dimension",
]


def _checked_fit_inputs(
    member_features: Any, labels: Any, num_classes: int, knn_k: int, bank_size: int, scores: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The training features as float64 (M, N, D) and their class ids (N,); InputError for a
    setting, a score, a shape or a value `FeatureStatistics.fit` cannot fit on."""
    for name, value in (("knn_k", knn_k), ("bank_size", bank_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive whole number, got {value!r}")
    unknown = sorted(set(scores) - set(feature_scores()))
    if unknown or not scores:
        raise InputError(f"unknown feature scores {unknown}; choose from {feature_scores()}")
    feats = np.asarray(torch.as_tensor(member_features).double().cpu(), dtype=np.float64)
    y = class_ids(labels, num_classes, "the training data").reshape(-1)
    if feats.ndim != 3 or feats.shape[1] != len(y) or len(y) < 2:
        raise InputError(
            f"feature statistics need (members, N >= 2, width) features and N labels, got "
            f"{feats.shape} and {len(y)}"
        )
    if not np.isfinite(feats).all():
        raise InputError("the training features hold NaN or Inf: the model diverged or overflowed")
    check_fit_memory(feats.shape[2])
    return feats, y


WIDTH_MATRICES = 4
"""The float64 width x width matrices the fit of one member holds at once at most (the
covariance, its shrunk copy, its inverse and the solver's workspace)."""


def check_fit_memory(width: int, available: int | None = None) -> None:
    """InputError, before any allocation, where the width x width float64 matrices a feature
    score's fit holds (`WIDTH_MATRICES` of them) exceed the memory available (``available``
    bytes; default: what the operating system reports, unchecked where it reports nothing)."""
    need = WIDTH_MATRICES * width * width * 8
    if available is None:
        available = _available_memory()
    if available is not None and need > available:
        raise InputError(
            f"features {width} wide need {need / 2**30:.1f} GiB for their {width} x {width} float64 "
            f"covariance matrices, and {available / 2**30:.1f} GiB are available: fit the statistics on a "
            "narrower layer (the model's pooled features), or on a machine with more memory"
        )


def _available_memory() -> int | None:
    """The bytes of memory the operating system reports available (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class FeatureStatistics:
    """What the feature scores of one model read, fit on its labelled ID training features:
    ``tensors`` (name -> float64 tensor with a leading member axis) and ``settings`` (members,
    classes, width, kNN's k, ViM's dimension, the training examples). Build with `fit`; a value
    type (save with `save`, read with `load`, compare with `digest`)."""

    tensors: Mapping[str, torch.Tensor]
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Held row-major, as `save` writes them and `load` reads them back: a matrix product
        # over a transposed layout (what numpy's eigenvectors and fancy indexing give) may round
        # differently, so fitted and loaded statistics would score unequally in float64.
        object.__setattr__(self, "tensors", {k: v.contiguous() for k, v in self.tensors.items()})

    @property
    def num_members(self) -> int:
        return int(self.settings["members"])

    @classmethod
    def fit(
        cls,
        member_features: Any,
        labels: Any,
        num_classes: int,
        heads: tuple[Any, Any] | None = None,
        *,
        knn_k: int = KNN_K,
        bank_size: int = BANK_SIZE,
        seed: int = 0,
        scores: Sequence[str] | None = None,
        layer_features: Any = None,
    ) -> FeatureStatistics:
        """Fit on training features ``(M, N, D)`` with their class ``labels`` (N,); ``heads``
        = each member's output layer ``(W (M, C, D), b (M, C))`` (`ood.features.member_heads`;
        without it, or with no more examples than ViM's principal dimension, ViM is not fit).
        Classes without an example have no mean (a warning says so). ``scores``: the feature
        scores to fit (every registered one by default, `registry.feature_scores`; fewer store
        less, e.g. ``("mds",)`` one precision matrix per member). ``layer_features``: each
        member's pooled token after every layer ``(M, N, L, D_h)`` (`predict`'s ``layers=True``),
        which ``mds_layers`` reads (without them it is not fit). ValueError where features are
        not finite or labels out of range."""
        scores = feature_scores() if scores is None else tuple(scores)
        feats, y = _checked_fit_inputs(member_features, labels, num_classes, knn_k, bank_size, scores)
        layers = _checked_layer_features(layer_features, feats.shape[:2], "the training")
        block = Block(feats, y, np.arange(len(y)), layers)
        counts = np.bincount(y, minlength=num_classes)
        layer_shape = None if layers is None else layers.shape[2:]
        return cls.fit_blocks(
            lambda summarise: [summarise(block)], feats.shape, counts, heads, layer_shape,
            knn_k=knn_k, bank_size=bank_size, seed=seed, scores=scores, whole=block,
        )  # fmt: skip

    @classmethod
    def fit_blocks(
        cls,
        map_blocks: Any,
        shape: tuple[int, int, int],
        class_counts: Any,
        heads: tuple[Any, Any] | None = None,
        layer_shape: tuple[int, int] | None = None,
        *,
        knn_k: int = KNN_K,
        bank_size: int = BANK_SIZE,
        seed: int = 0,
        scores: Sequence[str] | None = None,
        whole: Block | None = None,
    ) -> FeatureStatistics:
        """`fit` over training rows held in blocks, wherever they are: ``map_blocks(f)`` applies
        ``f`` to every `Block` (features (M, n, D) float64, class ids, each row's place among the
        ``shape[1]`` rows, their layer tokens where ``layer_shape`` is given) and returns the
        results in any order; ``shape`` = (members, rows, width) of all of them; ``class_counts``
        their rows per class. The scores are fit in their passes (`ood.passes`); one fit only in
        one process (`FeatureScore.passes` = 0) needs every row as one block, ``whole``, and is
        refused without it. Equal to `fit` on the same rows to float64 rounding."""
        scores = feature_scores() if scores is None else tuple(scores)
        counts = np.asarray(class_counts, np.float64)
        names, settings = fit_plan(
            scores, shape, counts, heads is not None, layer_shape, knn_k=knn_k, bank_size=bank_size
        )
        by_member = [name for name in names if not feature_score(name).passes]
        if by_member and whole is None:
            raise InputError(
                f"the OOD score {by_member[0]!r} is fit in one process only (it has no passes over "
                "blocks of rows): fit its statistics without a distributed engine"
            )
        heads = None if heads is None else tuple(np.asarray(torch.as_tensor(h).double().cpu()) for h in heads)
        context = PassContext(settings, heads, bank_rows(int(shape[1]), bank_size, seed), counts)
        in_passes = [name for name in names if name not in by_member]
        arrays = fit_in_passes(map_blocks, in_passes, context)
        tensors = {key: torch.from_numpy(np.asarray(value, np.float64)) for key, value in arrays.items()}
        if by_member:
            tensors.update(_fit_by_member(by_member, whole, context, tensors))
        return cls(tensors, settings)

    @property
    def scores(self) -> tuple[str, ...]:
        """The feature scores these statistics compute (ViM needs the output layers)."""
        return tuple(self.settings["scores"])

    def member_scores(
        self, score: str, member_features: Any, member_logits: Any = None, layer_features: Any = None
    ) -> torch.Tensor:
        """Each member's ``score`` (M, N), float64, from features ``(M, N, D)`` (for ViM, also
        the members' logits ``(M, N, C)`` at temperature 1; for ``mds_layers``, their pooled
        tokens after every layer ``(M, N, L, D_h)``)."""
        if score not in self.scores:
            raise InputError(f"unknown feature score {score!r}; these statistics compute {self.scores}")
        f = torch.as_tensor(member_features).to(torch.float64)
        if f.dim() != 3 or f.shape[0] != self.num_members or f.shape[2] != self.settings["width"]:
            raise InputError(
                f"features of shape {tuple(f.shape)} for statistics of {self.num_members} members of "
                f"width {self.settings['width']}"
            )
        layers = None
        if reads_layers(score):
            if layer_features is None:
                raise InputError(
                    f"the OOD score {score!r} reads every layer's features, and none were given "
                    "(predict with layers=True)"
                )
            layers = torch.as_tensor(layer_features).to(device=f.device, dtype=torch.float64)
            expected = (self.num_members, f.shape[1], self.settings["layers"], self.settings["layer_width"])
            if tuple(layers.shape) != expected:
                raise InputError(f"layer features of shape {tuple(layers.shape)}, expected {expected}")
        t = {name: value.to(f.device) for name, value in self.tensors.items()}
        logits = None if member_logits is None else torch.as_tensor(member_logits)
        compute = feature_score(score).score
        if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_compiling():
            return compute(f, t, ScoreContext(self.settings, logits, layers))  # one graph for any batch
        parts = []
        for start in range(0, f.shape[1], SCORE_ROWS):  # every part SCORE_ROWS rows (zeros fill the last)
            rows = slice(start, start + SCORE_ROWS)
            part = (
                _rows_of(f, rows),
                ScoreContext(self.settings, _rows_of(logits, rows), _rows_of(layers, rows)),
            )
            parts.append(compute(part[0], t, part[1])[:, : f[:, rows].shape[1]])
        return torch.cat(parts, 1) if parts else compute(f, t, ScoreContext(self.settings, logits, layers))

    def ensemble_scores(
        self, score: str, member_features: Any, member_logits: Any = None, layer_features: Any = None
    ) -> torch.Tensor:
        """The ensemble's ``score`` (N,): the mean of its members' scores."""
        return self.member_scores(score, member_features, member_logits, layer_features).mean(0)

    @property
    def reads_layers(self) -> bool:
        """Whether any score these statistics compute reads every layer's features."""
        return any(reads_layers(name) for name in self.scores)

    # ------------------------------------------------------------------ saving
    def digest(self) -> str:
        """SHA-256 of the settings and every tensor (what a calibration records of them)."""
        import hashlib

        from ..hashing import update_with_tensor

        digest = hashlib.sha256(json.dumps(dict(self.settings), sort_keys=True).encode())
        for name in sorted(self.tensors):
            update_with_tensor(digest, name, self.tensors[name])
        return digest.hexdigest()

    def save(self, path: str | os.PathLike) -> Path:
        """Write the statistics as one safetensors file (atomically)."""
        from safetensors.torch import save_file

        from ..saving.files import atomic_write

        tensors = {k: v.detach().cpu() for k, v in self.tensors.items()}  # row-major as held
        metadata = {"settings": json.dumps(dict(self.settings), sort_keys=True)}
        return atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    @classmethod
    def load(cls, path: str | os.PathLike, digest: str | None = None) -> FeatureStatistics:
        """Statistics written by `save`; with ``digest``, ValueError unless they are the ones it
        names (a calibration's record)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                settings = json.loads((handle.metadata() or {}).get("settings", "null"))
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(f"cannot read the OOD statistics {path}: {exc}") from None
        if not isinstance(settings, dict) or settings.get("format") != FORMAT:
            raise InputError(f"{path} is not a {FORMAT} file")
        loaded = cls(tensors, settings)
        if digest is not None and loaded.digest() != digest:
            raise InputError(
                f"{path} is not the OOD statistics the model's calibration was fit with (its digest "
                "differs): it was modified or comes from another model"
            )
        return loaded


def _rows_of(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """``x[:, rows]`` (members first) with zero rows after it up to `SCORE_ROWS` rows."""
    if x is None:
        return None
    part = x[:, rows]
    missing = SCORE_ROWS - part.shape[1]
    if missing == 0:
        return part
    return torch.cat([part, part.new_zeros((part.shape[0], missing, *part.shape[2:]))], 1)


def fit_plan(
    asked: Sequence[str],
    shape: tuple[int, int, int],
    class_counts: np.ndarray,
    heads: bool,
    layer_shape: tuple[int, int] | None,
    *,
    knn_k: int = KNN_K,
    bank_size: int = BANK_SIZE,
) -> tuple[list[str], dict[str, Any]]:
    """The scores a fit on training features of ``shape`` (members, rows, width) with
    ``class_counts`` rows per class fits, with those they read (registration order), and the
    statistics' settings; ``heads``: the output layers are given; ``layer_shape``: (layers,
    width) of every layer's tokens where given. Warns of a class without rows."""
    members, n, width = (int(v) for v in shape)
    missing = np.flatnonzero(np.asarray(class_counts) == 0).tolist()
    if missing:
        warnings.warn(
            f"classes {missing} have no training example: the class-conditional scores measure the "
            "distance to the other classes only",
            stacklevel=3,
        )
    fitted = _fitted_scores(asked, heads, layer_shape is not None, members, n, width)
    settings = {
        "format": FORMAT,
        "members": members,
        "classes": len(class_counts),
        "width": width,
        "examples": n,
        "knn_k": int(min(knn_k, n, bank_size)),
        "vim_dim": vim_dimension(width) if "vim" in fitted else None,
        "scores": fitted,
    }
    if layer_shape is not None and any(reads_layers(name) for name in fitted):
        settings["layers"], settings["layer_width"] = (int(v) for v in layer_shape)
    return _with_what_they_read(fitted), settings


def bank_rows(n: int, bank_size: int = BANK_SIZE, seed: int = 0) -> np.ndarray:
    """The training rows kept as the kNN bank: a seeded random subset of at most ``bank_size``
    of ``n``, in the order of the rows."""
    return np.sort(np.random.default_rng(seed).permutation(n)[:bank_size])


def _fit_by_member(
    names: list[str], block: Block, context: PassContext, fitted: dict
) -> dict[str, torch.Tensor]:
    """The arrays of the scores ``names`` fit by `FeatureScore.fit` member by member, then by
    `FeatureScore.fit_ensemble` across the members (scores not fit in passes)."""
    if not names:
        return {}
    parts: dict[str, list[np.ndarray]] = {}
    for m in range(block.features.shape[0]):
        head = None if context.heads is None else (context.heads[0][m], context.heads[1][m])
        layers = None if block.layers is None else block.layers[m]
        member = FitContext(head, context.bank_rows, context.settings, layers)
        for name in names:
            for key, value in (
                feature_score(name)
                .fit(block.features[m], block.labels, len(context.class_counts), member)
                .items()
            ):
                parts.setdefault(key, []).append(value)
    tensors = {name: torch.from_numpy(np.stack(values)) for name, values in parts.items()}
    layers = None if block.layers is None else torch.from_numpy(block.layers)
    across = ScoreContext(context.settings, None, layers)
    for name in names:
        fit = feature_score(name).fit_ensemble(
            torch.from_numpy(block.features), {**fitted, **tensors}, across
        )
        tensors.update({key: torch.from_numpy(np.asarray(v, np.float64)) for key, v in fit.items()})
    return tensors


def _fitted_scores(asked, heads: bool, layers: bool, members: int, n: int, width: int) -> list[str]:
    """The registered scores among ``asked`` that can be fit (in registration order): one that
    reads the output layers or every layer's features only where they are given, one of the
    members' disagreement only for two members or more, each only where the examples suffice."""
    return [
        name
        for name in feature_scores()
        if name in asked
        and (heads or not feature_score(name).needs_head)
        and (layers or not reads_layers(name))
        and (members > 1 or not feature_score(name).ensemble_only)
        and feature_score(name).can_fit(n, width)
    ]


def _checked_layer_features(
    layer_features: Any, members_and_rows: tuple[int, int], what: str
) -> np.ndarray | None:
    """``layer_features`` as float64 (M, N, L, D_h), or None; InputError for a shape that does not
    match the features' (M, N) or values that are not finite."""
    if layer_features is None:
        return None
    layers = np.asarray(torch.as_tensor(layer_features).double().cpu(), dtype=np.float64)
    if layers.ndim != 4 or layers.shape[:2] != tuple(members_and_rows):
        raise InputError(
            f"{what} layer features must be (members, inputs, layers, width) for {members_and_rows} "
            f"members and inputs, got {layers.shape}"
        )
    if not np.isfinite(layers).all():
        raise InputError(f"{what} layer features hold NaN or Inf: the model diverged or overflowed")
    return layers


def _with_what_they_read(names: list[str]) -> list[str]:
    """``names`` and the scores they read (rmds reads mds's class distance), in registration order."""
    needed = set(names) | {read for name in names for read in feature_score(name).reads}
    return [name for name in feature_scores() if name in needed]


def member_spread(member_scores: torch.Tensor) -> torch.Tensor:
    """The members' spread of a score (N,): their standard deviation (0 for one member)."""
    if member_scores.shape[0] < 2:
        return torch.zeros(member_scores.shape[1], dtype=member_scores.dtype)
    return member_scores.std(0, unbiased=False)


def check_scores(names: Sequence[str], statistics: FeatureStatistics | None) -> None:
    """ValueError naming a feature score among ``names`` that ``statistics`` cannot compute, and
    why."""
    for name in names:
        if name not in feature_scores() or (statistics is not None and name in statistics.scores):
            continue
        if statistics is not None and feature_score(name).ensemble_only and statistics.num_members < 2:
            raise InputError(
                f"the OOD score {name!r} measures the members' disagreement and needs an ensemble of two "
                "members or more; this model has one"
            )
        raise InputError(
            f"the OOD score {name!r} reads feature statistics fit on ID training data, and "
            + ("none were fit" if statistics is None else f"these compute only {statistics.scores}")
        )
