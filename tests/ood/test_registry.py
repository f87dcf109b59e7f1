"""OOD scores are registered classes: the built-in ones in their order, and the toy feature and
logit scores of docs/ood.md (one module, one registration each) fit, saved, scored, calibrated on
and served in records like the built-in ones."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_ensembles.calibration import Calibration
from hydra_ensembles.calibration.provenance import NO_DATA, DataRecord, Provenance
from hydra_ensembles.evaluation import Predictions, applicable_scores, ood_scores
from hydra_ensembles.ood import FeatureStatistics, registry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ood.md"


def _page_score(section: str, name: str, registered: dict, block: int = 0):
    """Run the page's module under ``section`` (its code block ``block``, after those before it,
    whose registrations are taken back), which registers the score ``name``; yield its namespace;
    take the registration back afterwards."""
    text = PAGE.read_text().split(section, 1)[1]
    codes = re.findall(r"```python\n(.*?)```", text.split("\n## ", 1)[0], flags=re.S)
    namespace: dict = {}
    for code in codes[: block + 1]:
        registered.pop(name, None)
        exec(compile(code, str(PAGE), "exec"), namespace)
    yield namespace
    registered.pop(name, None)


@pytest.fixture
def toy():
    """The page's toy feature score, registered; taken back afterwards."""
    for namespace in _page_score("## Adding a feature score", "norm", registry._REGISTRY):
        yield namespace["FeatureNorm"]


@pytest.fixture
def toy_in_passes():
    """The page's toy feature score written in passes, registered; taken back afterwards."""
    for namespace in _page_score("## Adding a feature score", "norm", registry._REGISTRY, block=1):
        yield namespace["FeatureNorm"]


@pytest.fixture
def margin():
    """The page's toy logit score, registered; taken back afterwards."""
    for namespace in _page_score("## Adding a logit score", "margin", registry._LOGIT_REGISTRY):
        yield namespace["Margin"]


def _features(members=2, n=60, width=5, seed=0, shift=0.0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    f = np.eye(3, width)[y][None] * 3 + rng.normal(size=(members, n, width)) + shift
    logits = np.einsum("mnd,cd->mnc", f, np.eye(3, width))
    return f, y, logits


def test_the_built_in_scores_are_registered_in_their_order():
    built_in = ("mds", "rmds", "mds++", "knn", "vim", "mds_layers", "mds_disagreement")
    assert registry.feature_scores()[:7] == built_in
    assert registry.feature_score("rmds").reads == ("mds",) and registry.feature_score("vim").needs_head
    assert registry.feature_score("mds_disagreement").reads == ("mds_layers",)
    assert registry.feature_score("mds_disagreement").ensemble_only
    with pytest.raises(ValueError, match="unknown feature score 'nope'"):
        registry.feature_score("nope")


def test_a_toy_score_is_one_module_and_one_registration(toy, tmp_path):
    assert "norm" in registry.feature_scores()
    with pytest.raises(ValueError, match="registered already"):

        @registry.register_feature_score
        class Other(registry.FeatureScore):
            name = "norm"

    f, y, _ = _features()
    stats = FeatureStatistics.fit(f, y, 3, scores=("mds", "norm"))
    assert stats.scores == ("mds", "norm") and set(stats.tensors) == {
        "mds.means",
        "mds.precision",
        "norm.mean",
    }
    test, _, test_logits = _features(n=9, seed=1, shift=2.0)
    expected = np.abs(np.linalg.norm(test, axis=-1) - np.linalg.norm(f, axis=-1).mean(1, keepdims=True))
    got = stats.member_scores("norm", test, test_logits)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    again = FeatureStatistics.load(stats.save(tmp_path / "stats.safetensors"), stats.digest())
    assert torch.equal(again.member_scores("norm", test), got)
    val = Predictions(*(lambda v: (v[2], v[1], v[0]))(_features(n=60, seed=2)))
    calibration = Calibration.fit(
        val, score="norm", keep=0.9, statistics=stats, provenance=Provenance(NO_DATA, DataRecord("train"))
    )
    records = calibration.records(Predictions(test_logits, None, test), ["a", "b", "c"])
    scores = ood_scores(Predictions(test_logits, None, test), "norm", statistics=stats)
    assert [r["ood_score_norm"] for r in records] == pytest.approx(scores.tolist())
    assert [r["flagged"] for r in records] == [bool(s > calibration.flag.threshold) for s in scores]


def test_the_toy_score_in_passes_fits_what_its_fit_fits_in_one_process_and_over_blocks(toy_in_passes):
    """The page's second module: the same arrays as the first's `fit` (to rounding), in one
    process and over blocks of rows."""
    from hydra_ensembles.ood.registry import Block

    assert toy_in_passes.passes == 1
    f, y, _ = _features()
    expected = np.linalg.norm(f, axis=-1).mean(1, keepdims=True)
    one = FeatureStatistics.fit(f, y, 3, scores=("norm",))
    np.testing.assert_allclose(one.tensors["norm.mean"].numpy(), expected, rtol=1e-14)
    blocks = np.array_split(np.random.default_rng(0).permutation(60), 4)
    over_blocks = FeatureStatistics.fit_blocks(
        lambda summarise: [summarise(Block(f[:, b], y[b], b)) for b in blocks], f.shape, np.bincount(y),
        scores=("norm",),
    )  # fmt: skip
    np.testing.assert_allclose(over_blocks.tensors["norm.mean"].numpy(), expected, rtol=1e-14)


def test_the_built_in_logit_scores_are_registered_in_their_order():
    assert registry.logit_scores()[:6] == (
        "msp",
        "max_logit",
        "energy",
        "entropy",
        "mutual_information",
        "gen",
    )
    single = Predictions(np.random.default_rng(0).normal(size=(1, 5, 3)))
    assert "mutual_information" not in applicable_scores(single)  # a single model has no disagreement
    with pytest.raises(ValueError, match="needs an ensemble"):
        ood_scores(single, "mutual_information")
    with pytest.raises(ValueError, match="registered already"):  # one namespace for both kinds

        @registry.register_logit_score
        class Clash(registry.LogitScore):
            name = "mds"


def test_a_toy_logit_score_is_one_module_and_one_registration(margin):
    rng = np.random.default_rng(4)
    val = Predictions(rng.normal(size=(3, 80, 4)) * 2, rng.integers(0, 4, 80))
    test = Predictions(rng.normal(size=(3, 9, 4)))
    assert "margin" in registry.logit_scores() and "margin" in applicable_scores(test)
    calibration = Calibration.fit(val, score="margin", keep=0.9)
    top = np.sort(test.probs(calibration.temperature), axis=-1)
    expected = 1.0 - (top[:, -1] - top[:, -2])
    scores = ood_scores(test, "margin", calibration.temperature)
    np.testing.assert_allclose(scores, expected, rtol=1e-12)
    records = calibration.records(test, ["a", "b", "c", "d"])
    assert [r["ood_score_margin"] for r in records] == pytest.approx(scores.tolist())
    assert [r["flagged"] for r in records] == [bool(s > calibration.flag.threshold) for s in scores]
