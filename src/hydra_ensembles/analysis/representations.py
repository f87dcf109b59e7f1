"""What heads represent (paper appendix B.2): each head's [CLS] vector in one layer, how far
apart its ID and OOD centroids are, and which heads separate ID from OOD.

For head h of a layer, Z[n, h] is the first token's output of that head (its slice of the
attention context, before W_O) for input n. The centroids of Z[:, h] over ID and OOD inputs are
compared by Euclidean distance and by Mahalanobis distance under the ID covariance of Z[:, h],
estimated with Ledoit-Wolf shrinkage (scikit-learn): a head's d_k-dimensional vectors from a few
hundred inputs give a singular or ill-conditioned sample covariance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..adapters import get_adapter
from ..batching import model_inputs
from ..errors import InputError
from ..surgery import kept_heads


@dataclass(frozen=True)
class HeadVectors:
    """[CLS] vectors (N, heads, d_k) of one layer's heads, and which original heads they are."""

    layer: int
    heads: tuple[int, ...]
    vectors: np.ndarray


def head_vectors(model: nn.Module, batches: Iterable[dict[str, Any]], layer: int = -1) -> HeadVectors:
    """The first token's per-head attention output in ``layer`` (negative: from the end) for
    every input of ``batches`` (labels, if any, are ignored)."""
    adapter = get_adapter(model)
    layers = adapter.num_layers(model)
    layer = layer % layers
    heads = kept_heads(model).resolve(adapter.original_heads_per_layer(model))[layer]
    if not heads:
        raise InputError(f"layer {layer} keeps no heads: there is nothing to represent")
    block = adapter.attention_block(model, layer)
    collected: list[torch.Tensor] = []

    def grab(_module: nn.Module, args: tuple) -> None:
        first = args[0][:, 0]  # (B, heads * d_k): the first token's context, before W_O
        collected.append(first.detach().float().unflatten(-1, (len(heads), block.head_dim)).cpu())

    handle = block.output.register_forward_pre_hook(grab)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            for batch in batches:
                model(**model_inputs(batch))
    finally:
        handle.remove()
        model.train(was_training)
    if not collected:
        raise InputError("no batches given")
    return HeadVectors(layer, tuple(heads), torch.cat(collected).numpy())


def mahalanobis(difference: np.ndarray, covariance: np.ndarray) -> float:
    """sqrt(d^T Sigma^-1 d), by a linear solve (no explicit inverse)."""
    return float(np.sqrt(max(difference @ np.linalg.solve(covariance, difference), 0.0)))


def centroid_distances(id_vectors: np.ndarray, ood_vectors: np.ndarray) -> list[dict[str, float]]:
    """Per head (axis 1): Euclidean and Mahalanobis distance between the ID and OOD centroids
    (Mahalanobis under the Ledoit-Wolf shrunk covariance of the ID vectors)."""
    from sklearn.covariance import LedoitWolf

    if id_vectors.ndim != 3 or ood_vectors.ndim != 3 or id_vectors.shape[1:] != ood_vectors.shape[1:]:
        raise InputError(
            "expected (N, heads, d_k) arrays of the same heads, "
            f"got {id_vectors.shape} and {ood_vectors.shape}"
        )
    if len(id_vectors) < 2 or len(ood_vectors) < 1:
        raise InputError("need at least 2 ID inputs (a covariance) and 1 OOD input")
    rows = []
    for h in range(id_vectors.shape[1]):
        ident, ood = id_vectors[:, h].astype(np.float64), ood_vectors[:, h].astype(np.float64)
        difference = ident.mean(0) - ood.mean(0)
        covariance = LedoitWolf().fit(ident).covariance_
        rows.append(
            {
                "euclidean": float(np.linalg.norm(difference)),
                "mahalanobis": mahalanobis(difference, covariance),
            }
        )
    return rows


def pca_2d(vectors: np.ndarray) -> np.ndarray:
    """Rows projected on their first two principal components (scikit-learn's PCA)."""
    from sklearn.decomposition import PCA

    return PCA(n_components=2, random_state=0).fit_transform(vectors.astype(np.float64))
