"""Every feature score against a plain NumPy/float64 implementation written from the papers
(scikit-learn's Ledoit-Wolf and empirical covariances, SciPy's logsumexp), on random features:
well-conditioned, wider than the examples (a singular sample covariance), a class with one
example, no spread at all, and features rounded to bf16 and fp16; saving and the digest."""

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from sklearn.covariance import EmpiricalCovariance, LedoitWolf

from hydra_ensembles.ood import FeatureStatistics, feature_scores, vim_dimension
from hydra_ensembles.ood.registry import reads_layers


def _data(members=2, n=60, width=8, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.0, size=(classes, width))
    y = np.arange(n) % classes
    feats = centres[y][None] + rng.normal(size=(members, n, width)) * rng.uniform(0.5, 2.0, size=width)
    weight = rng.normal(size=(members, classes, width))
    bias = rng.normal(size=(members, classes))
    queries = rng.normal(scale=2.5, size=(members, 7, width))
    logits = np.einsum("mcd,mnd->mnc", weight, queries) + bias[:, None]
    return feats, y, (weight, bias), queries, logits


def _mahalanobis(train, y, classes, queries):
    means = np.stack([train[y == c].mean(0) for c in range(classes)])
    precision = np.linalg.inv(LedoitWolf(assume_centered=True).fit(train - means[y]).covariance_)
    d = np.empty((len(queries), classes))
    for i, q in enumerate(queries):
        for c in range(classes):
            diff = q - means[c]
            d[i, c] = diff @ precision @ diff
    return d.min(1)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def reference(score, train, y, classes, queries, head=None, logits=None, k=50):
    """One member's score, written out."""
    if score == "mds":
        return _mahalanobis(train, y, classes, queries)
    if score == "mds++":
        return _mahalanobis(_unit(train), y, classes, _unit(queries))
    if score == "rmds":
        mean = train.mean(0)
        precision = np.linalg.inv(LedoitWolf().fit(train).covariance_)
        background = np.array([(q - mean) @ precision @ (q - mean) for q in queries])
        return _mahalanobis(train, y, classes, queries) - background
    if score == "knn":
        bank = _unit(train)
        k = min(k, len(train))
        return np.array([np.sort(np.linalg.norm(bank - q, axis=1))[k - 1] for q in _unit(queries)])
    weight, bias = head  # ViM, as its authors' and OpenOOD's code computes it
    origin = -np.matmul(np.linalg.pinv(weight), bias)
    covariance = EmpiricalCovariance(assume_centered=True).fit(train - origin).covariance_
    values, vectors = np.linalg.eig(covariance)
    null_space = np.ascontiguousarray(vectors[:, np.argsort(values * -1)[vim_dimension(train.shape[1]) :]])
    train_virtual = np.linalg.norm(np.matmul(train - origin, null_space), axis=-1)
    alpha = (train @ weight.T + bias).max(axis=-1).mean() / train_virtual.mean()
    virtual = np.linalg.norm(np.matmul(queries - origin, null_space), axis=-1) * alpha
    return virtual - logsumexp(logits, axis=-1)


def _check_all(feats, y, classes, head, queries, logits, rtol=1e-8):
    stats = FeatureStatistics.fit(feats, y, classes, head)
    for score in stats.scores:
        ours = stats.member_scores(score, queries, logits).numpy()
        for m in range(feats.shape[0]):
            member_head = (head[0][m], head[1][m])
            theirs = reference(score, feats[m], y, classes, queries[m], member_head, logits[m])
            scale = max(1.0, np.abs(theirs).max())
            assert np.abs(ours[m] - theirs).max() <= rtol * scale, score
        assert np.allclose(stats.ensemble_scores(score, queries, logits).numpy(), ours.mean(0))
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_score_matches_its_written_out_definition(seed):
    feats, y, head, queries, logits = _data(seed=seed)
    # every score but those that read every layer's features (tests/ood/test_layer_scores.py)
    assert _check_all(feats, y, 3, head, queries, logits).scores == tuple(
        s for s in feature_scores() if not reads_layers(s)
    )


def test_wider_features_than_examples_shrink_to_an_invertible_covariance():
    feats, y, head, queries, logits = _data(n=12, width=40, seed=3)
    stats = _check_all(feats, y, 3, head, queries, logits, rtol=1e-6)
    assert np.isfinite(stats.member_scores("mds", queries).numpy()).all()
    # ViM's residual is empty where the examples fit inside its principal subspace: not fit
    assert stats.scores == ("mds", "rmds", "mds++", "knn")


def test_a_class_with_one_example():
    feats, y, head, queries, logits = _data(n=40, seed=4)
    y = np.where(y == 2, 0, y)
    y[5] = 2  # class 2 has exactly one example: its mean is that example
    stats = _check_all(feats, y, 3, head, queries, logits)
    own = stats.member_scores("mds", feats[:, 5:6]).numpy()
    assert np.allclose(own, 0.0, atol=1e-9)  # an example is at distance 0 from its own class mean


def test_no_spread_gives_distance_zero_with_a_warning():
    feats = np.repeat(np.eye(3)[None, np.arange(9) % 3], 1, axis=0)  # every feature is its class mean
    with pytest.warns(UserWarning, match="no spread"):
        stats = FeatureStatistics.fit(feats, np.arange(9) % 3, 3)
    assert np.allclose(stats.member_scores("mds", feats).numpy(), 0.0)


def test_knn_keeps_at_most_bank_size_features_and_k_at_most_the_bank():
    feats, y, _, queries, _ = _data(n=30, seed=5)
    stats = FeatureStatistics.fit(feats, y, 3, bank_size=10)
    assert stats.tensors["knn.bank"].shape == (2, 10, 8) and stats.settings["knn_k"] == 10
    assert "vim" not in stats.scores  # no output layers given
    with pytest.raises(ValueError, match="these statistics compute"):
        stats.member_scores("vim", queries)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_features_are_scored_in_float64(dtype):
    """Features a bf16/fp16 model computed are scored exactly as their float64 values: the only
    difference from fp32 is the features' own rounding."""
    feats, y, head, queries, logits = _data(seed=6)
    rounded = torch.as_tensor(feats).to(dtype)
    q = torch.as_tensor(queries).to(dtype)
    stats = _check_all(rounded.double().numpy(), y, 3, head, q.double().numpy(), logits)
    low = FeatureStatistics.fit(rounded, y, 3, head)
    for score in low.scores:
        assert torch.equal(
            low.member_scores(score, q, logits), stats.member_scores(score, q.double(), logits)
        )


def test_refusals():
    feats, y, _, queries, _ = _data()
    with pytest.warns(UserWarning, match=r"classes \[1\] have no training example"):
        partial = FeatureStatistics.fit(feats, np.where(y == 1, 0, y), 3)
    assert partial.tensors["mds.means"].shape == (2, 2, 8)  # the two classes with examples
    assert np.isfinite(partial.member_scores("mds", queries).numpy()).all()
    bad = feats.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        FeatureStatistics.fit(bad, y, 3)
    with pytest.raises(ValueError, match="out of range"):
        FeatureStatistics.fit(feats, y + 1, 3)
    stats = FeatureStatistics.fit(feats, y, 3)
    with pytest.raises(ValueError, match="width"):
        stats.member_scores("mds", feats[:, :, :4])


def test_saved_statistics_load_equal_and_a_changed_file_is_refused(tmp_path):
    feats, y, head, queries, logits = _data()
    stats = FeatureStatistics.fit(feats, y, 3, head)
    assert all(t.is_contiguous() for t in stats.tensors.values())  # as loaded: equal layouts round alike
    path = stats.save(tmp_path / "s.safetensors")
    loaded = FeatureStatistics.load(path, digest=stats.digest())
    assert loaded.digest() == stats.digest() and dict(loaded.settings) == dict(stats.settings)
    for score in stats.scores:
        assert torch.equal(
            loaded.member_scores(score, queries, logits), stats.member_scores(score, queries, logits)
        )
    other = FeatureStatistics.fit(feats[:, ::-1].copy(), y, 3, head)
    other.save(path)
    with pytest.raises(ValueError, match="digest differs"):
        FeatureStatistics.load(path, digest=stats.digest())
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read"):
        FeatureStatistics.load(tmp_path / "junk.safetensors")


def test_fitting_fewer_scores_stores_less():
    feats, y, head, queries, _ = _data()
    full = FeatureStatistics.fit(feats, y, 3, head)
    mds = FeatureStatistics.fit(feats, y, 3, head, scores=("mds",))
    assert set(mds.tensors) == {"mds.means", "mds.precision"} and mds.scores == ("mds",)
    assert torch.equal(mds.member_scores("mds", queries), full.member_scores("mds", queries))
    rmds = FeatureStatistics.fit(feats, y, 3, scores=("rmds",))  # reads mds's means and precision
    assert rmds.scores == ("rmds",) and torch.equal(
        rmds.member_scores("rmds", queries), full.member_scores("rmds", queries)
    )
    with pytest.raises(ValueError, match="unknown feature scores"):
        FeatureStatistics.fit(feats, y, 3, scores=("mahalanobis",))


@pytest.mark.slow
def test_a_4096_wide_decoder_feature_fits():
    """A 4096-wide feature (a 7B decoder's): one precision matrix of 4096 x 4096 float64 (128 MiB)
    per member, fit on fewer examples than dimensions, scores finite."""
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1, 600, 4096)).astype(np.float32)
    y = np.arange(600) % 2
    stats = FeatureStatistics.fit(feats, y, 2, scores=("mds",))
    assert stats.tensors["mds.precision"].shape == (1, 4096, 4096)
    assert torch.isfinite(stats.member_scores("mds", feats[:, :10])).all()


def test_an_inputs_score_is_the_same_number_in_any_batch():
    """Every built-in feature score of one input, bitwise, alone and at any place of batches of
    other inputs of any size (below, at and past `SCORE_ROWS`), as the calibration, predict and a
    Ray worker's batches score it."""
    from hydra_ensembles.ood.detectors import SCORE_ROWS

    rng = np.random.default_rng(4)
    members, n, width, depth = 2, 200, 48, 3
    y = np.arange(n) % 3
    feats = rng.normal(size=(members, n, width)) + y[None, :, None]
    layers = rng.normal(size=(members, n, depth, 6)) + y[None, :, None, None]
    head = (rng.normal(size=(members, 3, width)), rng.normal(size=(members, 3)))
    stats = FeatureStatistics.fit(feats, y, 3, head, layer_features=layers)
    assert len(stats.scores) == 7
    one, one_layers = rng.normal(size=(members, 1, width)), rng.normal(size=(members, 1, depth, 6))
    logits = lambda f: np.einsum("mnd,mcd->mnc", f, head[0]) + head[1][:, None]  # noqa: E731
    alone = {s: stats.member_scores(s, one, logits(one), one_layers) for s in stats.scores}
    for size, place in ((7, 3), (SCORE_ROWS, SCORE_ROWS - 1), (SCORE_ROWS + 5, SCORE_ROWS + 2), (150, 20)):
        batch, batch_layers = (
            rng.normal(size=(members, size, width)),
            rng.normal(size=(members, size, depth, 6)),
        )
        batch[:, place], batch_layers[:, place] = one[:, 0], one_layers[:, 0]
        for score, expected in alone.items():
            got = stats.member_scores(score, batch, logits(batch), batch_layers)[:, place : place + 1]
            assert torch.equal(got, expected), (score, size, place)
