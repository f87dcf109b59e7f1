"""The features each member's output layer reads, recorded in the forward pass: for every family
and every kind of ensemble they are what the output layer maps to the logits (W f + b = logits,
member by member), a fused model's members read what each member run alone reads, and BERT's
feature is its pooled output."""

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.baselines.batch_ensemble import batch_ensemble
from hydra_ensembles.baselines.head_ensemble import head_ensemble
from hydra_ensembles.baselines.mimo import mimo
from hydra_ensembles.baselines.packed import packed_ensemble
from hydra_ensembles.evaluation import predict
from hydra_ensembles.members.ensemble import as_ensemble
from hydra_ensembles.ood.features import FeatureTap, ensemble_heads
from tests.factories import FAMILIES, PRECISIONS, labelled, rounding_tolerance

HEADS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({1: [3], 2: [0, 1]})]


def _model(family: str, seed: int = 0, layers: int = 3):
    factory, inputs = FAMILIES[family]
    return factory(layers=layers, heads=4, head_dim=3, init_range=0.3, seed=seed).eval(), inputs


def _affine(ensemble, features: torch.Tensor) -> torch.Tensor:
    weight, bias = ensemble_heads(as_ensemble(ensemble))
    return torch.einsum("mcd,mnd->mnc", weight, features.double()) + bias[:, None]


def _check_affine(model, x, tol=1e-5):
    ensemble = as_ensemble(model).eval()
    with torch.no_grad():
        out = ensemble(**x)
    assert out.member_features is not None and out.member_features.shape[:2] == out.member_logits.shape[:2]
    assert (_affine(model, out.member_features) - out.member_logits.double()).abs().max() <= tol
    return out


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deit"])
def test_a_single_models_features_give_its_logits(family):
    model, inputs = _model(family)
    _check_affine(model, inputs(batch=4))


def test_deit_with_two_heads_has_no_single_feature():
    model, inputs = _model("deit")
    out = as_ensemble(model).eval()(**inputs(batch=2))
    if len([n for n in ("cls_classifier", "distillation_classifier") if hasattr(model, n)]) == 2:
        assert out.member_features is None
    else:
        _check_affine(model, inputs(batch=2))


def test_bert_feature_is_the_pooled_output():
    model, inputs = _model("bert")
    x = inputs(batch=3)
    with torch.no_grad(), FeatureTap(model) as tap:
        model(**x)
        pooled = model.bert(**x).pooler_output
    assert torch.equal(tap.features(x, 3)[0], pooled)


def test_a_decoder_feature_is_its_last_real_token():
    model, inputs = _model("llama")
    x = inputs(batch=4)
    assert bool((x["attention_mask"] == 0).any())  # padded rows
    with torch.no_grad(), FeatureTap(model) as tap:
        hidden = model.model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state
        model(**x)
    lengths = x["attention_mask"].sum(-1) - 1  # right padding: the last real token
    expected = hidden[torch.arange(4), lengths]
    assert torch.allclose(tap.features(x, 4)[0], expected, atol=1e-6)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "deit"])
@pytest.mark.parametrize("mlp", ["exact", "merge"])
def test_fused_members_read_what_each_member_reads_alone(family, mlp):
    model, inputs = _model(family, seed=1)
    members = [he.prune(model, h) for h in HEADS]
    with torch.no_grad():
        for i, member in enumerate(members):  # fine-tuned members differ everywhere
            g = torch.Generator().manual_seed(10 + i)
            for p in member.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    fused = he.fuse(members, mlp="exact").eval() if mlp == "exact" else he.fuse(model, HEADS).eval()
    if mlp == "merge":
        members = [he.prune(model, h) for h in HEADS]
    x = inputs(batch=5, seed=2)
    out = _check_affine(fused, x, tol=1e-4)
    explicit = _check_affine(members, x)
    assert (out.member_features - explicit.member_features).abs().max() <= 1e-4


@pytest.mark.parametrize("precision", PRECISIONS)
def test_predict_returns_the_features_in_every_precision(precision):
    model, inputs = _model("bert", seed=3)
    fused = he.fuse(model, HEADS).eval()
    x = labelled(inputs(batch=6))
    preds = predict(fused, [x], progress=False, precision=precision)
    reference = predict(fused, [x], progress=False, precision="fp32")
    assert preds.member_features.shape == (3, 6, 12) and preds.member_features.dtype == "float32"
    tol = rounding_tolerance(precision, torch.as_tensor(reference.member_features), layers=3, fp32=1e-6)
    assert abs(preds.member_features - reference.member_features).max() <= tol


@pytest.mark.parametrize(
    "make",
    [
        lambda m: batch_ensemble(m, 3, init_std=0.3, seed=1),
        lambda m: head_ensemble(m, 3, seed=2),
        lambda m: mimo(m, 3, seed=1),
        lambda m: packed_ensemble(m, 2, 2, 1, seed=1),
    ],
    ids=["batch_ensemble", "head_ensemble", "mimo", "packed"],
)
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "dinov2"])
def test_every_baseline_has_features_that_give_its_logits(make, family):
    if family == "bert":
        factory, inputs = FAMILIES[family]
        model = factory(layers=2, heads=4, head_dim=3, init_range=0.3, intermediate=24).eval()
    else:
        model, inputs = _model(family, layers=2)
    _check_affine(make(model).eval(), inputs(batch=4))


def test_mc_dropout_samples_have_their_own_features():
    model, inputs = _model("bert")
    model.config.hidden_dropout_prob = 0.3
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.3
    ensemble = as_ensemble(model, mc_samples=3)
    x = inputs(batch=4)
    torch.manual_seed(0)
    with torch.no_grad():
        out = ensemble(**x)
    weight, bias = ensemble_heads(ensemble)
    logits = torch.einsum("mcd,mnd->mnc", weight, out.member_features.double()) + bias[:, None]
    assert (logits - out.member_logits.double()).abs().max() <= 1e-5
    assert not torch.equal(out.member_features[0], out.member_features[1])


def test_zero_shot_features_are_the_unit_input_embeddings_of_each_member():
    from hydra_ensembles.zero_shot import fuse_dual_encoder
    from tests.factories import image_inputs, tiny_clip_zero_shot

    model = tiny_clip_zero_shot(classes=3, templates=2, heads_pool="both")
    head_sets = [he.HeadSet({0: [0, 1], 1: [2]}), he.HeadSet({0: [3], 1: []}), he.HeadSet({1: [0, 3]})]
    fused = fuse_dual_encoder(model, head_sets)
    x = image_inputs(5, seed=1)
    out = _check_affine(fused, x)
    explicit = _check_affine([he.prune(model, hs) for hs in head_sets], x)
    assert (out.member_features - explicit.member_features).abs().max() <= 1e-5
    assert torch.allclose(out.member_features.norm(dim=-1), torch.ones(3, 5))
