"""Head representations against explicit attention and independent distance references (SciPy)."""

import numpy as np
import pytest
import torch
from scipy.spatial.distance import mahalanobis as scipy_mahalanobis
from sklearn.covariance import LedoitWolf

import hydra_ensembles as he
from hydra_ensembles.analysis.representations import centroid_distances, head_vectors, pca_2d
from tests.factories import text_inputs, tiny_bert


def _explicit_cls_heads(model, inputs, layer):
    """The first token's per-head context in ``layer``, written out from the layer's input."""
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states[layer]
        core = model.bert.encoder.layer[layer].attention.self
        b, t, _ = hidden.shape
        h, dh = core.num_attention_heads, core.attention_head_size
        q, k, v = (
            lin(hidden).view(b, t, h, dh).transpose(1, 2) for lin in (core.query, core.key, core.value)
        )
        scores = q @ k.transpose(-1, -2) / dh**0.5
        scores = scores.masked_fill(inputs["attention_mask"][:, None, None, :] == 0, float("-inf"))
        return (scores.softmax(-1) @ v)[:, :, 0].numpy()  # (B, heads, d_k)


@pytest.mark.parametrize("layer", [0, -1])
def test_head_vectors_are_each_heads_first_token_output(layer):
    model = tiny_bert(layers=3, heads=4, head_dim=3, init_range=0.3, dropout=0.0)
    batches = [text_inputs(3, 7, seed=s) for s in range(2)]
    got = head_vectors(model, batches, layer)
    expected = np.concatenate([_explicit_cls_heads(model, b, layer % 3) for b in batches])
    assert got.heads == (0, 1, 2, 3) and got.vectors.shape == (6, 4, 3)
    assert np.allclose(got.vectors, expected, atol=1e-5)
    pruned = he.prune(model, he.HeadSet({2: [1, 3]}))
    kept = head_vectors(pruned, batches, -1)
    assert kept.heads == (1, 3) and np.allclose(
        kept.vectors, head_vectors(model, batches, -1).vectors[:, [1, 3]], atol=1e-5
    )


def test_centroid_distances_match_scipy_under_the_ledoit_wolf_covariance():
    rng = np.random.default_rng(0)
    ident = rng.normal(size=(40, 3, 5)) * np.array([1.0, 2.0, 0.5])[None, :, None]
    ood = rng.normal(size=(30, 3, 5)) + np.array([0.0, 1.0, 3.0])[None, :, None]
    rows = centroid_distances(ident, ood)
    for h, row in enumerate(rows):
        difference = ident[:, h].mean(0) - ood[:, h].mean(0)
        inverse = np.linalg.inv(LedoitWolf().fit(ident[:, h]).covariance_)
        assert row["euclidean"] == pytest.approx(np.linalg.norm(difference))
        assert row["mahalanobis"] == pytest.approx(
            scipy_mahalanobis(ident[:, h].mean(0), ood[:, h].mean(0), inverse)
        )
    assert rows[2]["euclidean"] > rows[1]["euclidean"] > rows[0]["euclidean"]


def test_more_dimensions_than_inputs_still_give_finite_distances():
    rng = np.random.default_rng(1)
    rows = centroid_distances(rng.normal(size=(4, 2, 16)), rng.normal(size=(3, 2, 16)) + 1)
    assert all(np.isfinite(r["mahalanobis"]) and r["mahalanobis"] > 0 for r in rows)
    assert pca_2d(rng.normal(size=(10, 16))).shape == (10, 2)
    with pytest.raises(ValueError, match="same heads"):
        centroid_distances(rng.normal(size=(4, 2, 16)), rng.normal(size=(3, 3, 16)))
