"""Every built-in feature score's statistics fit in passes over blocks of rows equal the
one-process fit on the same rows to 1e-10 relative in float64, in any block order and split
(shuffled, uneven, one-row blocks, split otherwise in every pass), for one member and several,
with a class absent and features far from the origin; a score fit only in one process is
refused over blocks; the merge of means and spreads against numpy's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_ensembles.errors import InputError
from hydra_ensembles.ood import FeatureStatistics, feature_scores
from hydra_ensembles.ood.passes import merge_spread, spread, spread_summary
from hydra_ensembles.ood.registry import Block, FeatureScore, register_feature_score


def _blocks(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A shuffled split of range(n) into uneven blocks, one-row blocks and an empty one among them."""
    order = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, 12), replace=False))
    blocks = [*np.split(order, cuts), order[:0]]
    return [blocks[i] for i in rng.permutation(len(blocks))]


def _fit_in_blocks(x, y, classes, heads, layers, rng, **kwargs):
    def map_blocks(summarise):
        parts = _blocks(x.shape[1], rng)  # every pass split otherwise
        return [summarise(Block(x[:, b], y[b], b, None if layers is None else layers[:, b])) for b in parts]

    counts = np.bincount(y, minlength=classes)
    return FeatureStatistics.fit_blocks(map_blocks, x.shape, counts, heads, layers.shape[2:], **kwargs)


def _davis_kahan(x: np.ndarray, statistics: FeatureStatistics) -> float:
    """The largest, over the members, of ViM's residual space's error bound: the rounding of the
    scatter around the origin (n eps lambda_max) over the eigenvalue gap at the principal cut."""
    worst, cut = 0.0, statistics.settings["vim_dim"]
    for features, origin in zip(x, statistics.tensors["vim.origin"].numpy(), strict=True):
        centred = features - origin
        values = np.sort(np.linalg.eigvalsh(centred.T @ centred / len(centred)))[::-1]
        error = len(centred) * np.finfo(np.float64).eps * values[0] / (values[cut - 1] - values[cut])
        worst = max(worst, float(error))
    return worst


def _projector(basis: torch.Tensor) -> torch.Tensor:
    """ViM's residual space as a projector (its basis is unique up to signs and rotations)."""
    return basis @ basis.transpose(-1, -2)


@pytest.mark.parametrize(
    ("members", "classes", "width", "offset"), [(1, 3, 5, 0.0), (3, 4, 16, 0.0), (3, 4, 16, 1e4)]
)
def test_passes_over_blocks_fit_what_one_process_fits(members, classes, width, offset):
    """``offset``: features far from the origin, where one pass over raw moments loses digits.
    The statistics agree to 1e-10 relative (the kNN bank exactly). A distance computed from them
    differs by what the rounding of the means (a sum of n rows of size |mu|: n eps |mu| per
    coordinate) becomes through the distance's gradient ``2 P (f - mu)``; rmds, a difference of
    two distances, twice that: the bound below. ViM's covariance is around the output layer's
    origin, not the features' mean, so far from it every fit of its residual space is as exact
    as Davis and Kahan's bound allows: the scatter's rounding (n eps lambda_max) over the gap of
    the eigenvalues at its cut; its arrays (the space as a projector) and scores within that, or
    1e-10 where it is smaller."""
    rng = np.random.default_rng(members)
    n, depth = 300, 3
    y = rng.integers(0, classes - 1, n)  # the last class has no row
    x = rng.normal(size=(members, n, width)) * rng.uniform(0.1, 3, width) + offset + y[None, :, None]
    layers = rng.normal(size=(members, n, depth, 4)) + y[None, :, None, None]
    heads = (rng.normal(size=(members, classes, width)), rng.normal(size=(members, classes)))
    kwargs = {"bank_size": 40, "knn_k": 5}  # a bank smaller than the rows: the seeded rows kept
    with pytest.warns(UserWarning, match="no training example"):
        expected = FeatureStatistics.fit(x, y, classes, heads, layer_features=layers, **kwargs)
        got = _fit_in_blocks(x, y, classes, heads, layers, rng, **kwargs)
    fitted = {"mds", "rmds", "mds++", "knn", "vim", "mds_layers"} | (
        {"mds_disagreement"} if members > 1 else set()
    )
    assert set(expected.scores) == fitted and got.settings == expected.settings
    assert set(got.tensors) == set(expected.tensors)
    vim = max(1e-10, _davis_kahan(x, expected))
    for key, value in expected.tensors.items():
        mine, rtol = got.tensors[key], vim if key.startswith("vim.") else 1e-10
        if key == "vim.basis":
            mine, value = _projector(mine), _projector(value)
        torch.testing.assert_close(mine, value, rtol=rtol, atol=rtol * value.abs().max().item())
    assert torch.equal(got.tensors["knn.bank"], expected.tensors["knn.bank"])
    test = rng.normal(size=(members, 7, width)) + offset
    test_layers = rng.normal(size=(members, 7, depth, 4))
    logits = np.einsum("mnd,mcd->mnc", test, heads[0]) + heads[1][:, None]
    largest = max(
        torch.linalg.matrix_norm(expected.tensors[f"{s}.precision"], ord=2).max()
        for s in ("mds", "rmds", "mds++")
    )
    mean_error = n * np.finfo(np.float64).eps * (abs(offset) + classes) * np.sqrt(width)
    bound = 2 * 2 * float(largest) * (np.abs(test - offset).max() + classes + 1) * mean_error
    for score in expected.scores:
        ours = got.member_scores(score, test, logits, test_layers)
        theirs = expected.member_scores(score, test, logits, test_layers)
        scale = theirs.abs().max().item()
        atol = bound if score in ("mds", "rmds", "mds++") else (vim if score == "vim" else 1e-9) * scale
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=atol, msg=score)


def test_a_score_fit_only_in_one_process_is_refused_over_blocks():
    @register_feature_score
    class OneProcess(FeatureScore):
        name = "one_process_only"

        def fit(self, x, y, classes, context):
            return {"one_process_only.mean": x.mean(0)}

        def score(self, f, tensors, context):
            return f.sum(-1)

    try:
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(1, 20, 3)), np.arange(20) % 2
        assert "one_process_only" in FeatureStatistics.fit(x, y, 2).scores  # one process: fit
        with pytest.raises(InputError, match="'one_process_only' is fit in one process only"):
            _fit_in_blocks(x, y, 2, None, np.zeros((1, 20, 1, 1)), rng, scores=("mds", "one_process_only"))
    finally:
        from hydra_ensembles.ood import registry

        registry._REGISTRY.pop("one_process_only")
    assert "one_process_only" not in feature_scores()


def test_merged_means_and_spreads_equal_numpys():
    rng = np.random.default_rng(3)
    values = rng.normal(size=(2, 3, 500)) + 1e4  # far from zero: raw moments would lose 8 digits
    parts = [spread_summary(values[..., b]) for b in _blocks(500, rng)]
    mean, std = spread(merge_spread(parts))
    np.testing.assert_allclose(mean, values.mean(-1), rtol=1e-14)
    np.testing.assert_allclose(std, values.std(-1), rtol=1e-10)
