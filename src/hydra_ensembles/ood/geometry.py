"""The linear algebra the feature scores share, in float64: shrunk covariances and their
inverses, Mahalanobis distances, unit-length features."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def ledoit_wolf(x: np.ndarray) -> np.ndarray:
    """The Ledoit-Wolf shrunk covariance of the centred rows ``x`` (scikit-learn's estimator)."""
    x2 = x**2
    return shrunk_covariance(x.T @ x, float(np.sum(x2.T @ x2)), len(x))


def shrunk_covariance(scatter: np.ndarray, fourth: float, n: int) -> np.ndarray:
    """`ledoit_wolf` from the sums it reads, which add up over any split of the rows: the scatter
    ``sum_i x_i x_i^T`` (D, D) and ``sum_i |x_i|^4`` of ``n`` centred rows."""
    d = scatter.shape[0]
    emp = scatter / n
    mu = np.trace(emp) / d
    if mu <= 0:
        return emp
    delta_ = float(np.sum(emp**2))
    beta = (fourth / n - delta_) / (d * n)
    delta = (delta_ - 2 * mu * np.trace(emp) + d * mu**2) / d
    shrinkage = 0.0 if delta <= 0 else min(beta, delta) / delta
    return (1 - shrinkage) * emp + shrinkage * mu * np.eye(d)


def precision_matrix(x: np.ndarray, what: str) -> np.ndarray:
    """The inverse of the shrunk covariance of the centred rows ``x`` (its pseudo-inverse where it
    has no spread at all, with a warning naming ``what``)."""
    return inverse_covariance(ledoit_wolf(x), what)


def inverse_covariance(covariance: np.ndarray, what: str) -> np.ndarray:
    """The inverse of a shrunk covariance (its pseudo-inverse where it has no spread at all, with
    a warning naming ``what``)."""
    if np.trace(covariance) <= 0:
        warnings.warn(
            f"{what}: the training features have no spread around their means; the Mahalanobis "
            "distance is 0 for every input (fit on more varied data)",
            stacklevel=5,
        )
    try:  # positive definite (what shrinkage gives): its inverse through a Cholesky factor
        inverse = np.linalg.inv(np.linalg.cholesky(covariance))
        return inverse.T @ inverse
    except np.linalg.LinAlgError:
        return np.linalg.pinv(covariance, hermitian=True)


def normalised(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` at unit length (numpy)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def unit(f: torch.Tensor) -> torch.Tensor:
    """Rows of ``f`` at unit length (torch)."""
    return f / torch.linalg.vector_norm(f, dim=-1, keepdim=True).clamp_min(1e-12)


def class_means_and_precision(x: np.ndarray, y: np.ndarray, classes: int, what: str) -> dict[str, np.ndarray]:
    """The means of the classes present in ``y`` (K, D) and one precision matrix (D, D) of the
    features around their class means: what the Mahalanobis scores read."""
    present = np.unique(y)  # sorted; a class without examples has no mean
    means = np.zeros((classes, x.shape[1]))
    means[present] = np.stack([x[y == c].mean(0) for c in present])
    return {f"{what}.means": means[present], f"{what}.precision": precision_matrix(x - means[y], what)}


def distance(f: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """Squared Mahalanobis distances (M, N, K) of features (M, N, D) to means (M, K, D)."""
    fp = f @ precision  # (M, N, D)
    own = (fp * f).sum(-1, keepdim=True)  # f^T P f
    mp = means @ precision  # (M, K, D)
    cross = fp @ means.transpose(1, 2)  # f^T P mu
    return own - 2 * cross + (mp * means).sum(-1).unsqueeze(1)


def min_distance(f: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """The squared Mahalanobis distance (M, N) to the closest of the means."""
    return distance(f, means, precision).min(-1).values


def vim_dimension(width: int) -> int:
    """ViM's principal dimension for features of ``width`` (Wang et al.'s choices: 1000 for
    2048-wide features, 512 for 768-wide ones; half the width below that)."""
    if width >= 1500:
        return 1000
    if width >= 768:
        return 512
    return max(1, width // 2)
