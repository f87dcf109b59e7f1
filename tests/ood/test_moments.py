"""The Mahalanobis scores' statistics from sums over blocks of rows equal the one-process fit on
the same rows to 1e-10 relative in float64, in any block order and split (shuffled, uneven,
one-row blocks), for one member and several, with a class absent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_ensembles.ood import FeatureStatistics
from hydra_ensembles.ood.moments import MERGEABLE_SCORES, add, first_sums, second_sums, statistics_from_sums


def _blocks(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A shuffled split of range(n) into uneven blocks, one-row blocks among them."""
    order = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, 12), replace=False))
    blocks = np.split(order, cuts)
    return [blocks[i] for i in rng.permutation(len(blocks))]


@pytest.mark.parametrize(("members", "classes", "width", "offset"), [(1, 3, 5, 0.0), (3, 4, 16, 1e4)])
def test_sums_over_blocks_fit_what_one_process_fits(members, classes, width, offset):
    """``offset``: features far from the origin, where one pass over raw moments loses digits.
    The statistics agree to 1e-10 relative. A distance computed from them differs by what the
    rounding of the means (a sum of n rows of size |mu|: n eps |mu| per coordinate) becomes
    through the distance's gradient ``2 P (f - mu)``; rmds, a difference of two distances, twice
    that: the bound below."""
    rng = np.random.default_rng(members)
    n = 300
    y = rng.integers(0, classes - 1, n)  # the last class has no row
    x = rng.normal(size=(members, n, width)) * rng.uniform(0.1, 3, width) + offset + y[None, :, None]
    with pytest.warns(UserWarning, match="no training example"):
        expected = FeatureStatistics.fit(x, y, classes, scores=MERGEABLE_SCORES)
    blocks = _blocks(n, rng)
    first = add(first_sums(x[:, b], y[b], classes) for b in blocks)
    blocks = _blocks(n, rng)  # the second pass split otherwise
    second = add(second_sums(x[:, b], y[b], first) for b in blocks)
    got = statistics_from_sums(first, second, classes)
    assert got.settings == expected.settings
    assert set(got.tensors) == set(expected.tensors)
    for key, value in expected.tensors.items():
        torch.testing.assert_close(got.tensors[key], value, rtol=1e-10, atol=1e-10 * value.abs().max().item())
    test = rng.normal(size=(members, 7, width)) + offset
    largest = max(
        torch.linalg.matrix_norm(expected.tensors[f"{s}.precision"], ord=2).max() for s in MERGEABLE_SCORES
    )
    mean_error = n * np.finfo(np.float64).eps * (abs(offset) + classes) * np.sqrt(width)
    bound = 2 * 2 * float(largest) * (np.abs(test - offset).max() + classes + 1) * mean_error
    for score in MERGEABLE_SCORES:
        got_scores, expected_scores = got.member_scores(score, test), expected.member_scores(score, test)
        torch.testing.assert_close(got_scores, expected_scores, rtol=1e-10, atol=bound)
