"""Feature scores are registered classes: the built-in ones in their order, and a toy score from
docs/ood.md (one module, one registration) fit, saved, scored, calibrated on and served in
records like the built-in ones."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_ensembles.evaluation import Calibration, Predictions, ood_scores
from hydra_ensembles.ood import FEATURE_SCORES, FeatureStatistics, registry

PAGE = Path(__file__).resolve().parents[2] / "docs" / "ood.md"


@pytest.fixture
def toy():
    """The page's toy score, registered; taken back afterwards."""
    section = PAGE.read_text().split("## Adding a feature score", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    yield namespace["FeatureNorm"]
    registry._REGISTRY.pop("norm", None)


def _features(members=2, n=60, width=5, seed=0, shift=0.0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    f = np.eye(3, width)[y][None] * 3 + rng.normal(size=(members, n, width)) + shift
    logits = np.einsum("mnd,cd->mnc", f, np.eye(3, width))
    return f, y, logits


def test_the_built_in_scores_are_registered_in_their_order():
    assert registry.feature_scores()[:5] == FEATURE_SCORES == ("mds", "rmds", "mds++", "knn", "vim")
    assert registry.feature_score("rmds").reads == ("mds",) and registry.feature_score("vim").needs_head
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
    calibration = Calibration.fit(val, score="norm", keep=0.9, statistics=stats, statistics_data="train")
    records = calibration.records(Predictions(test_logits, None, test), ["a", "b", "c"])
    scores = ood_scores(Predictions(test_logits, None, test), "norm", statistics=stats)
    assert [r["ood_score_norm"] for r in records] == pytest.approx(scores.tolist())
    assert [r["flagged"] for r in records] == [bool(s > calibration.threshold) for s in scores]
