"""Every layer's view: the pooled token each member has after every transformer layer, recorded
in the forward pass (a fused model's equal to its members' run one by one, read here from
Hugging Face's own ``output_hidden_states``), the ``mds_layers`` and ``mds_disagreement``
scores against an explicit computation (scikit-learn's Ledoit-Wolf covariance), and their
conformal flags' ID false-alarm rate, simulated. The served paths (records, pipeline, ONNX) are
in tests/serving."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.calibration import Calibration
from hydra_ensembles.evaluation import Predictions, predict
from hydra_ensembles.evaluation.conformal import flag_count
from hydra_ensembles.ood import FeatureStatistics
from tests.factories import (
    decoder_inputs,
    image_inputs,
    labelled,
    text_inputs,
    tiny_bert,
    tiny_decoder,
    tiny_vit,
)

CASES = {
    "bert": (tiny_bert, text_inputs, [he.HeadSet({0: [0, 1]}), he.HeadSet({0: [0, 1], 1: [1, 2]})]),
    "bert-ragged": (
        tiny_bert,
        text_inputs,
        [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({1: [1]}), he.HeadSet({})],
    ),
    "decoder": (tiny_decoder, decoder_inputs, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})]),
    "vit": (tiny_vit, image_inputs, [he.HeadSet({0: [0]}), he.HeadSet({0: [1], 1: [0]})]),
}


def _explicit(member: torch.nn.Module, inputs: dict, last_token: bool) -> torch.Tensor:
    """(B, L, D): the member's pooled token after every layer, from ``output_hidden_states`` (a
    decoder's last entry there is after the final norm: its last layer's own output is read from
    that layer instead)."""
    with torch.no_grad():
        hidden = list(member(**inputs, output_hidden_states=True).hidden_states[1:])
        if last_token:
            seen = []
            last = member.model.layers[-1]
            handle = last.register_forward_hook(
                lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out)
            )
            member(**inputs)
            handle.remove()
            hidden[-1] = seen[0]
    if not last_token:
        return torch.stack([h[:, 0] for h in hidden], 1)
    pad = member.config.pad_token_id
    last = (torch.arange(inputs["input_ids"].shape[1]) * (inputs["input_ids"] != pad)).argmax(-1)
    return torch.stack([h[torch.arange(h.shape[0]), last] for h in hidden], 1)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("batch", [1, 5])
def test_a_fused_models_layer_features_are_its_members_run_one_by_one(case, batch):
    make, inputs_of, head_sets = CASES[case]
    torch.manual_seed(0)
    model = make().eval()
    inputs = inputs_of(batch=batch, seed=batch)
    if case == "decoder" and batch > 1:  # ragged texts, padded with the model's pad id
        inputs["input_ids"][0, -2:] = model.config.pad_token_id
        inputs["attention_mask"][0, -2:] = 0
    hydra = he.fuse(model, head_sets).eval()
    got = predict(hydra, [inputs], progress=False, precision="fp32", layers=True).layer_features
    members = [he.prune(copy.deepcopy(model), hs).eval() for hs in head_sets]
    expected = torch.stack([_explicit(m, inputs, case == "decoder") for m in members]).numpy()
    assert (
        got.shape
        == expected.shape
        == (len(head_sets), batch, model.config.num_hidden_layers, expected.shape[-1])
    )
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # a deep ensemble of the same members and a single model record the same views
    ensemble = predict(members, [inputs], progress=False, precision="fp32", layers=True).layer_features
    np.testing.assert_allclose(ensemble, expected, rtol=1e-4, atol=1e-5)
    single = predict(members[0], [inputs], progress=False, precision="fp32", layers=True).layer_features
    np.testing.assert_allclose(single, expected[:1], rtol=1e-4, atol=1e-5)
    # only where asked: no layer features by default, and the model is left as it was
    assert predict(hydra, [inputs], progress=False, precision="fp32").layer_features is None
    assert hydra.record_layers is False


def test_a_shared_trunks_layers_are_every_members():
    """In the trunk, the layers run once for all members: each member's view is that one row."""
    torch.manual_seed(0)
    model = tiny_bert().eval()
    head_sets = [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({0: [0, 1, 2], 1: [1]})]
    hydra = he.fuse(model, head_sets).eval()
    assert hydra.trunk_layers == 1
    inputs = text_inputs(batch=4)
    got = predict(hydra, [inputs], progress=False, precision="fp32", layers=True).layer_features
    members = [he.prune(copy.deepcopy(model), hs).eval() for hs in head_sets]
    expected = torch.stack([_explicit(m, inputs, False) for m in members]).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def _reference(layers_train, y, layers_test, classes):
    """mds_layers by hand: per layer, class means and scikit-learn's Ledoit-Wolf covariance of
    the centred training tokens, the smallest Mahalanobis distance, standardised by its training
    mean and standard deviation, averaged over the layers."""
    return np.mean(_reference_z(layers_train, y, layers_test, classes), 0)


def _reference_z(layers_train, y, layers_test, classes):
    """The standardised distance of each test token at each layer by hand (L, N)."""
    from sklearn.covariance import LedoitWolf

    z = []
    for layer in range(layers_train.shape[1]):
        h, t = layers_train[:, layer], layers_test[:, layer]
        means = np.stack([h[y == c].mean(0) for c in range(classes)])
        precision = np.linalg.inv(LedoitWolf(assume_centered=True).fit(h - means[y]).covariance_)

        def dist(x, means=means, precision=precision):
            d = x[:, None] - means[None]
            return np.einsum("nkd,de,nke->nk", d, precision, d).min(1)

        train = dist(h)
        z.append((dist(t) - train.mean()) / train.std())
    return np.stack(z)


def _layered(seed, members, n, layers, width, classes, tested):
    """Class-clustered training tokens at every layer (M, n, L, D), wider test tokens (M, tested,
    L, D), their labels, features and the statistics fit on them."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    train = rng.normal(size=(members, n, layers, width)) + 2 * np.eye(classes, width)[y][None, :, None]
    test = rng.normal(size=(members, tested, layers, width)) * 1.5
    features = rng.normal(size=(members, n, 4))
    stats = FeatureStatistics.fit(features, y, classes, layer_features=train)
    return rng, y, train, test, features, stats


def test_mds_layers_against_an_explicit_computation():
    members, classes = 2, 3
    rng, y, train, test, features, stats = _layered(0, members, 300, 3, 5, classes, tested=40)
    assert "mds_layers" in stats.scores and stats.reads_layers
    got = stats.member_scores("mds_layers", rng.normal(size=(members, 40, 4)), None, test).numpy()
    for m in range(members):
        np.testing.assert_allclose(got[m], _reference(train[m], y, test[m], classes), rtol=1e-8, atol=1e-8)
    # without layer features it is not fit, and it is refused where they are missing
    assert "mds_layers" not in FeatureStatistics.fit(features, y, classes).scores
    with pytest.raises(ValueError, match="reads every layer's features"):
        stats.member_scores("mds_layers", features)
    with pytest.raises(ValueError, match="layer features of shape"):
        stats.member_scores("mds_layers", features, None, train[:, :, :2])
    with pytest.raises(ValueError, match="layer features must be"):
        FeatureStatistics.fit(features, y, classes, layer_features=train[:, :10])


def test_mds_disagreement_against_an_explicit_computation():
    """The layer mean and the members' per-layer spread of the hand-computed z, each standardised
    by its mean and standard deviation over the training inputs, summed; a member's score is its
    own layer mean standardised alike plus the shared disagreement, so the members' mean is it."""
    members, classes = 3, 3
    rng, y, train, test, features, stats = _layered(2, members, 250, 3, 4, classes, tested=30)
    z_train = np.stack([_reference_z(train[m], y, train[m], classes) for m in range(members)])  # (M, L, N)
    z_test = np.stack([_reference_z(train[m], y, test[m], classes) for m in range(members)])
    a_train, s_train = z_train.mean(1).mean(0), z_train.std(0).mean(0)
    own, s_test = z_test.mean(1), z_test.std(0).mean(0)
    expected = (own - a_train.mean()) / a_train.std() + ((s_test - s_train.mean()) / s_train.std())[None]
    got = stats.member_scores("mds_disagreement", rng.normal(size=(members, 30, 4)), None, test).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-8, atol=1e-8)
    # the ensemble's score on its own training inputs is standardised: mean 0
    on_train = stats.ensemble_scores("mds_disagreement", features, None, train).numpy()
    assert abs(on_train.mean()) < 1e-9
    # a single model has no disagreement: not fit for one member, and asking for it says why
    single = FeatureStatistics.fit(features[:1], y, classes, layer_features=train[:1])
    assert "mds_disagreement" not in single.scores
    one = Predictions(rng.normal(size=(1, 30, classes)), y[:30], rng.normal(size=(1, 30, 4)), test[:1])
    with pytest.raises(ValueError, match="needs an ensemble of two members or more"):
        Calibration.fit(one, score="mds_disagreement", statistics=single)


def test_mds_disagreement_ranks_inputs_the_members_see_differently_above_those_they_agree_on():
    """Two inputs with the same mean layer score: one that both members see alike, one that member
    0 sees far from the training classes and member 1 near them. mds_layers cannot tell them
    apart; the disagreement term ranks the second higher."""
    rng = np.random.default_rng(3)
    n, layers, width, classes = 400, 2, 3, 2
    y = rng.integers(0, classes, n)
    shared = rng.normal(size=(n, layers, width)) + 3 * np.eye(classes, width)[y][:, None]
    train = np.stack([shared + 0.05 * rng.normal(size=shared.shape) for _ in range(2)])  # members agree
    stats = FeatureStatistics.fit(rng.normal(size=(2, n, 4)), y, classes, layer_features=train)
    centre = 3 * np.eye(classes, width)[0]
    offset = np.array([0.0, 0.0, 1.0])
    agree = np.stack([centre + 2.0 * offset, centre + 2.0 * offset])  # both members: distance 4
    differ = np.stack([centre + math.sqrt(8) * offset, centre])  # member 0: distance 8, member 1: 0
    tokens = np.stack([agree, differ], 1)[:, :, None].repeat(layers, 2)  # (M=2, N=2, L, D)
    features = np.zeros((2, 2, 4))
    by_layers = stats.ensemble_scores("mds_layers", features, None, tokens).numpy()
    both = stats.ensemble_scores("mds_disagreement", features, None, tokens).numpy()
    assert by_layers[1] == pytest.approx(by_layers[0], rel=0.05)
    assert both[1] > both[0] + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mds_layers_saves_loads_and_scores_rounded_tokens_in_float64(tmp_path, dtype):
    """Saved statistics score as before; tokens a bf16/fp16 model computed score exactly as their
    float64 values (the only difference from fp32 is the tokens' own rounding)."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 200)
    train = torch.as_tensor(rng.normal(size=(2, 200, 3, 6)) + np.eye(3, 6)[y][None, :, None]).to(dtype)
    test = torch.as_tensor(rng.normal(size=(2, 30, 3, 6))).to(dtype)
    features = rng.normal(size=(2, 200, 4))
    low = FeatureStatistics.fit(features, y, 3, layer_features=train)
    exact = FeatureStatistics.fit(features, y, 3, layer_features=train.double())
    loaded = FeatureStatistics.load(low.save(tmp_path / "s.safetensors"), digest=low.digest())
    for score in ("mds_layers", "mds_disagreement"):
        assert torch.equal(
            low.member_scores(score, features[:, :30], None, test),
            exact.member_scores(score, features[:, :30], None, test.double()),
        )
        assert torch.equal(
            loaded.member_scores(score, features[:, :30], None, test),
            low.member_scores(score, features[:, :30], None, test),
        )


def _draw(rng, n, classes=3, members=2, layers=3, width=4):
    """ID predictions: labels, logits that favour them, and class-clustered tokens at every layer."""
    y = rng.integers(0, classes, n)
    logits = rng.normal(size=(members, n, classes)) + 0.5 * np.eye(classes)[y][None]
    tokens = rng.normal(size=(members, n, layers, width)) + 2.0 * np.eye(classes, width)[y][None, :, None]
    return Predictions(logits, y, rng.normal(size=(members, n, 4)), tokens)


@pytest.mark.parametrize(
    ("n", "keep", "score"),
    [
        # CI's slow run: the README's test command checks the conformal flag's bound on any
        # score by simulation (test_conformal.py), and that a layer score is a fixed function of
        # each input's own features (test_detectors.py::test_an_inputs_score_is_the_same_number_in_any_batch)
        pytest.param(99, 0.95, "mds_layers", marks=pytest.mark.slow),
        pytest.param(99, 0.95, "mds_disagreement", marks=pytest.mark.slow),
        pytest.param(49, 0.9, "mds_layers", marks=pytest.mark.slow),
        pytest.param(49, 0.9, "mds_disagreement", marks=pytest.mark.slow),
    ],
)
def test_a_flag_on_every_layers_view_keeps_its_id_false_alarm_bound(n, keep, score):
    """Each combination is a fixed function of each input's own features (fit on ID training data
    only), so the conformal threshold on n ID validation scores flags fresh ID inputs at
    floor((n + 1) alpha)/(n + 1) <= alpha = 1 - keep in expectation: simulated over many calibration
    draws through `Calibration.fit` and `Calibration.records`, as predict serves the flag."""
    rng = np.random.default_rng(n)
    train = _draw(rng, 600)
    stats = FeatureStatistics.fit(train.member_features, train.labels, 3, layer_features=train.layer_features)
    trials, fresh, flagged = 300, 40, []
    for _ in range(trials):
        calibration = Calibration.fit(_draw(rng, n), score=score, keep=keep, statistics=stats)
        assert calibration.flag.reads_layers
        flagged.append(np.mean([r["flagged"] for r in calibration.records(_draw(rng, fresh))]))
    alpha = calibration.flag.alpha  # 1 - keep, as the p-values compare it in floating point
    expected = flag_count(n, alpha) / (n + 1)
    # the trials are independent; within one the fresh inputs share its threshold
    error = np.std(flagged) / math.sqrt(trials)
    assert np.mean(flagged) == pytest.approx(expected, abs=4 * error) and expected <= alpha


def test_fit_statistics_fits_every_layers_view_unless_told_not_to():
    from hydra_ensembles.calibration import fit_statistics

    torch.manual_seed(0)
    model = tiny_bert().eval()
    batches = [
        labelled(text_inputs(batch=12, seed=s), labels=model.config.num_labels, seed=s) for s in range(3)
    ]
    assert "mds_layers" in fit_statistics(model, batches, precision="fp32", progress=False).scores
    without = fit_statistics(model, batches, precision="fp32", progress=False, layers=False)
    assert "mds_layers" not in without.scores and "mds" in without.scores
