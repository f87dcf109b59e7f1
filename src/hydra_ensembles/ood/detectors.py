"""Feature-space OOD scores, fit on labelled ID training features, for each member of an ensemble.

Every score is "higher = more likely OOD" and is computed per member on that member's own
features (`ood.features`); the ensemble's score is the **mean of its members' scores** (and the
members' spread is their standard deviation). All statistics are fit and every score computed in
float64, whatever precision the model ran in.

- ``mds``: Mahalanobis distance to the closest class mean under one covariance shared by the
  classes (Lee et al., 2018), ``min_c (f - mu_c)^T P (f - mu_c)``.
- ``rmds``: relative Mahalanobis (Ren et al., 2021): the class distance minus the distance to the
  mean of all training features under their own covariance, ``min_c d_c(f) - d_0(f)``.
- ``mds++``: ``mds`` on L2-normalised features (Mueller and Hein, 2025, "Mahalanobis++").
- ``knn``: the Euclidean distance of the normalised feature to its k-th nearest normalised
  training feature (Sun et al., 2022; k = 50, or the bank's size if smaller).
- ``vim``: virtual-logit matching (Wang et al., 2022): ``alpha * ||(f - o) R|| - logsumexp(logits)``
  with ``o = -pinv(W) b`` the origin the output layer maps to zero logits, ``R`` the directions of
  the (uncentred, around ``o``) training covariance outside its ``k`` principal ones, and
  ``alpha`` the training mean of the largest logit over the mean residual norm.

The covariances are Ledoit-Wolf shrinkage estimates (the shrinkage is close to 0 where examples
far outnumber dimensions, and keeps the matrix invertible where they do not: few examples, wide
features, features rounded to bf16); a covariance with no spread at all (every feature equal to
its class mean) has no inverse, and its pseudo-inverse (zero) is used. What is stored, per member:
class means (C x D) and one precision matrix (D x D) for each of mds, mds++ and rmds's background,
the kNN bank (at most ``bank_size`` normalised training features, N x D) and ViM's origin and
residual basis (D x (D - k)): about ``(4 D + 2 C + N) D`` float64 numbers per member.
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

FEATURE_SCORES = ("mds", "rmds", "mds++", "knn", "vim")
KNN_K = 50
"""Neighbours of the kNN score (OpenOOD's setting; capped at the bank's size)."""
BANK_SIZE = 10_000
"""At most this many training features per member are kept for kNN (a seeded random subset)."""
STATISTICS_NAME = "ood_statistics.safetensors"
FORMAT = "hydra-ensembles/ood-statistics"

__all__ = ["BANK_SIZE", "FEATURE_SCORES", "KNN_K", "STATISTICS_NAME", "FeatureStatistics", "vim_dimension"]


def vim_dimension(width: int) -> int:
    """ViM's principal dimension for features of ``width`` (Wang et al.'s choices: 1000 for
    2048-wide features, 512 for 768-wide ones; half the width below that)."""
    if width >= 1500:
        return 1000
    if width >= 768:
        return 512
    return max(1, width // 2)


def _ledoit_wolf(x: np.ndarray) -> np.ndarray:
    """The Ledoit-Wolf shrunk covariance of the centred rows ``x`` (scikit-learn's estimator)."""
    n, d = x.shape
    emp = x.T @ x / n
    mu = np.trace(emp) / d
    if mu <= 0:
        return emp
    x2 = x**2
    beta_ = float(np.sum(x2.T @ x2))
    delta_ = float(np.sum(emp**2))
    beta = (beta_ / n - delta_) / (d * n)
    delta = (delta_ - 2 * mu * np.trace(emp) + d * mu**2) / d
    shrinkage = 0.0 if delta <= 0 else min(beta, delta) / delta
    return (1 - shrinkage) * emp + shrinkage * mu * np.eye(d)


def _precision(x: np.ndarray, what: str) -> np.ndarray:
    covariance = _ledoit_wolf(x)
    if np.trace(covariance) <= 0:
        warnings.warn(
            f"{what}: the training features have no spread around their means; the Mahalanobis "
            "distance is 0 for every input (fit on more varied data)",
            stacklevel=4,
        )
    try:  # positive definite (what shrinkage gives): its inverse through a Cholesky factor
        inverse = np.linalg.inv(np.linalg.cholesky(covariance))
        return inverse.T @ inverse
    except np.linalg.LinAlgError:
        return np.linalg.pinv(covariance, hermitian=True)


def _normalised(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@dataclass(frozen=True)
class FeatureStatistics:
    """What the feature scores of one model read, fit on its labelled ID training features:
    ``tensors`` (name -> float64 tensor with a leading member axis) and ``settings`` (members,
    classes, width, kNN's k, ViM's dimension, the training examples). Build with `fit`; a value
    type (save with `save`, read with `load`, compare with `digest`)."""

    tensors: Mapping[str, torch.Tensor]
    settings: Mapping[str, Any] = field(default_factory=dict)

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
        scores: Sequence[str] = FEATURE_SCORES,
    ) -> FeatureStatistics:
        """Fit on training features ``(M, N, D)`` with their class ``labels`` (N,); ``heads``
        = each member's output layer ``(W (M, C, D), b (M, C))`` (`ood.features.member_heads`;
        without it, or with no more examples than ViM's principal dimension, ViM is not fit).
        Classes without an example have no mean (a warning says so). ``scores``: the feature
        scores to fit (all by default; fewer store less, e.g. ``("mds",)`` one precision matrix
        per member). ValueError where features are not finite or labels out of range."""
        for name, value in (("knn_k", knn_k), ("bank_size", bank_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive whole number, got {value!r}")
        unknown = sorted(set(scores) - set(FEATURE_SCORES))
        if unknown or not scores:
            raise InputError(f"unknown feature scores {unknown}; choose from {FEATURE_SCORES}")
        feats = np.asarray(torch.as_tensor(member_features).double().cpu(), dtype=np.float64)
        y = class_ids(labels, num_classes, "the training data").reshape(-1)
        if feats.ndim != 3 or feats.shape[1] != len(y) or len(y) < 2:
            raise InputError(
                f"feature statistics need (members, N >= 2, width) features and N labels, got "
                f"{feats.shape} and {len(y)}"
            )
        if not np.isfinite(feats).all():
            raise InputError("the training features hold NaN or Inf: the model diverged or overflowed")
        missing = sorted(set(range(num_classes)) - set(y.tolist()))
        if missing:
            warnings.warn(
                f"classes {missing} have no training example: the class-conditional scores measure the "
                "distance to the other classes only",
                stacklevel=2,
            )
        members, n, width = feats.shape
        k = min(knn_k, n, bank_size)
        bank_rows = np.sort(np.random.default_rng(seed).permutation(n)[:bank_size])
        if heads is not None and (n <= vim_dimension(width) or "vim" not in scores):
            heads = None  # the training features lie inside ViM's principal subspace: no residual
        parts: dict[str, list[np.ndarray]] = {}
        for m in range(members):
            head = None if heads is None else (np.asarray(heads[0][m], np.float64), np.asarray(heads[1][m]))
            for name, value in _fit_member(feats[m], y, num_classes, head, bank_rows, scores).items():
                parts.setdefault(name, []).append(value)
        tensors = {name: torch.from_numpy(np.stack(values)) for name, values in parts.items()}
        settings = {
            "format": FORMAT,
            "members": members,
            "classes": int(num_classes),
            "width": width,
            "examples": n,
            "knn_k": int(k),
            "vim_dim": vim_dimension(width) if heads is not None else None,
            "scores": [s for s in FEATURE_SCORES if s in scores and (s != "vim" or heads is not None)],
        }
        return cls(tensors, settings)

    @property
    def scores(self) -> tuple[str, ...]:
        """The feature scores these statistics compute (ViM needs the output layers)."""
        return tuple(self.settings["scores"])

    def member_scores(self, score: str, member_features: Any, member_logits: Any = None) -> torch.Tensor:
        """Each member's ``score`` (M, N), float64, from features ``(M, N, D)`` (and, for ViM,
        the members' logits ``(M, N, C)`` at temperature 1)."""
        if score not in self.scores:
            raise InputError(f"unknown feature score {score!r}; these statistics compute {self.scores}")
        f = torch.as_tensor(member_features).to(torch.float64)
        if f.dim() != 3 or f.shape[0] != self.num_members or f.shape[2] != self.settings["width"]:
            raise InputError(
                f"features of shape {tuple(f.shape)} for statistics of {self.num_members} members of "
                f"width {self.settings['width']}"
            )
        t = {name: value.to(f.device) for name, value in self.tensors.items()}
        if score == "mds":
            return _min_distance(f, t["mds.means"], t["mds.precision"])
        if score == "mds++":
            return _min_distance(_unit(f), t["mds++.means"], t["mds++.precision"])
        if score == "rmds":
            background = _distance(f, t["rmds.mean"].unsqueeze(1), t["rmds.precision"]).squeeze(-1)
            return _min_distance(f, t["mds.means"], t["mds.precision"]) - background
        if score == "knn":
            similarity = _unit(f) @ t["knn.bank"].transpose(1, 2)  # (M, N, bank)
            kth = similarity.topk(int(self.settings["knn_k"]), dim=-1).values[..., -1]
            return (2 - 2 * kth).clamp_min(0).sqrt()
        if member_logits is None:
            raise InputError("ViM reads the members' logits as well as their features")
        logits = torch.as_tensor(member_logits).to(device=f.device, dtype=torch.float64)
        residual = torch.linalg.vector_norm((f - t["vim.origin"].unsqueeze(1)) @ t["vim.basis"], dim=-1)
        return t["vim.alpha"].unsqueeze(1) * residual - torch.logsumexp(logits, -1)

    def ensemble_scores(self, score: str, member_features: Any, member_logits: Any = None) -> torch.Tensor:
        """The ensemble's ``score`` (N,): the mean of its members' scores."""
        return self.member_scores(score, member_features, member_logits).mean(0)

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

        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
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


def _fit_member(
    x: np.ndarray,
    y: np.ndarray,
    classes: int,
    head: tuple[np.ndarray, np.ndarray] | None,
    bank: np.ndarray,
    scores: Sequence[str],
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    present = np.unique(y)  # sorted; a class without examples has no mean
    for name, feats in (("mds", x), ("mds++", _normalised(x))):
        if name in scores or (name == "mds" and "rmds" in scores):  # rmds reads mds's statistics
            means = np.zeros((classes, x.shape[1]))
            means[present] = np.stack([feats[y == c].mean(0) for c in present])
            out[f"{name}.means"] = means[present]
            out[f"{name}.precision"] = _precision(feats - means[y], name)
    if "rmds" in scores:
        out["rmds.mean"] = x.mean(0)
        out["rmds.precision"] = _precision(x - x.mean(0), "rmds")
    if "knn" in scores:
        out["knn.bank"] = _normalised(x[bank])
    if head is not None:
        weight, bias = head
        origin = -np.linalg.pinv(weight) @ bias
        centred = x - origin
        values, vectors = np.linalg.eigh(centred.T @ centred / len(x))
        principal = vim_dimension(x.shape[1])
        basis = vectors[:, np.argsort(-values)[principal:]]  # outside the principal subspace
        residual = np.linalg.norm(centred @ basis, axis=-1).mean()
        largest = (x @ weight.T + bias).max(-1).mean()
        out["vim.origin"] = origin
        out["vim.basis"] = basis
        out["vim.alpha"] = np.asarray(largest / residual if residual > 0 else 0.0)
    return out


def _unit(f: torch.Tensor) -> torch.Tensor:
    return f / torch.linalg.vector_norm(f, dim=-1, keepdim=True).clamp_min(1e-12)


def _distance(f: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distances (M, N, K) of features (M, N, D) to means (M, K, D)."""
    fp = f @ precision  # (M, N, D)
    own = (fp * f).sum(-1, keepdim=True)  # f^T P f
    mp = means @ precision  # (M, K, D)
    cross = fp @ means.transpose(1, 2)  # f^T P mu
    return own - 2 * cross + (mp * means).sum(-1).unsqueeze(1)


def _min_distance(f: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    return _distance(f, means, precision).min(-1).values


def member_spread(member_scores: torch.Tensor) -> torch.Tensor:
    """The members' spread of a score (N,): their standard deviation (0 for one member)."""
    if member_scores.shape[0] < 2:
        return torch.zeros(member_scores.shape[1], dtype=member_scores.dtype)
    return member_scores.std(0, unbiased=False)


def check_scores(names: Sequence[str], statistics: FeatureStatistics | None) -> None:
    """ValueError naming a feature score among ``names`` that ``statistics`` cannot compute."""
    for name in names:
        if name in FEATURE_SCORES and (statistics is None or name not in statistics.scores):
            raise InputError(
                f"the OOD score {name!r} reads feature statistics fit on ID training data, and "
                + ("none were fit" if statistics is None else "these have none for it")
            )
