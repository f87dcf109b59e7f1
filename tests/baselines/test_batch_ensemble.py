"""BatchEnsemble baseline: layers against explicit per-member linears, the converted model
against its members run one by one, training, prediction, save/load, and clear refusals."""

import numpy as np
import pytest
import torch
from torch import nn

import hydra_ensembles as he
from hydra_ensembles.baselines import batch_ensemble, batch_ensemble_members
from hydra_ensembles.evaluation import predict
from hydra_ensembles.layers import BatchEnsembleLinear
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import FineTuneConfig, fine_tune
from tests.factories import (
    FAMILIES,
    PRECISIONS,
    computing_in,
    labelled,
    rounding_tolerance,
    text_inputs,
    tiny_bert,
)

TOL = 1e-5


@pytest.mark.parametrize(("members", "batch"), [(1, 3), (3, 1), (4, 5)])
def test_layer_equals_each_members_linear(members, batch):
    base = nn.Linear(7, 5)
    layer = BatchEnsembleLinear.from_linear(base, members, 0.5, torch.Generator().manual_seed(0))
    x = torch.randn(members * batch, 2, 7)
    out = layer(x)
    for m in range(members):
        rows = slice(m * batch, (m + 1) * batch)
        torch.testing.assert_close(out[rows], layer.member_linear(m)(x[rows]), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="multiple of"):
        BatchEnsembleLinear.from_linear(base, 3, 0.5)(torch.randn(4, 7))


def test_factors_start_at_one_without_spread():
    layer = BatchEnsembleLinear.from_linear(nn.Linear(4, 3), 2, 0.0)
    assert torch.equal(layer.r, torch.ones(2, 4)) and torch.equal(layer.s, torch.ones(2, 3))


def _member_models(model, converted):
    """Member m as a plain copy of ``model`` whose linears are member m's."""
    members = []
    for m in range(batch_ensemble_members(converted)):
        member = type(model)(model.config).eval()
        state = {}
        for name, module in converted.named_modules():
            if isinstance(module, BatchEnsembleLinear):
                linear = module.member_linear(m)
                state[f"{name}.weight"], state[f"{name}.bias"] = linear.weight, linear.bias
        full = {k: v for k, v in converted.state_dict().items() if k in member.state_dict()}
        member.load_state_dict({**full, **state})
        members.append(member)
    return members


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["bert", "distilbert", "vit", "dinov2", "clip"])
def test_converted_model_equals_its_members_one_by_one(family, precision):
    """In every precision: equal to the members one by one in the same precision, within
    rounding (`rounding_tolerance`), and to the members in fp32 within the same bound."""
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    converted = batch_ensemble(model, 3, init_std=0.3, seed=1).eval()
    assert batch_ensemble_members(converted) == 3 and batch_ensemble_members(model) == 1
    x = inputs(batch=4)
    preds = predict(converted, [x], progress=False, precision=precision)
    assert preds.member_logits.shape == (3, 4, 3) and preds.member_logits.dtype == np.float32
    members = _member_models(model, converted)
    with torch.no_grad(), computing_in(precision):
        expected = torch.stack([m(**x).logits.float() for m in members])
    with torch.no_grad():
        exact = torch.stack([m(**x).logits for m in members])
    tol = rounding_tolerance(precision, exact, layers=2, fp32=1e-4)
    assert (torch.as_tensor(preds.member_logits) - expected).abs().max().item() <= tol
    assert (torch.as_tensor(preds.member_logits) - exact).abs().max().item() <= tol
    assert not torch.allclose(expected[0], expected[1])  # the factors make members differ


def test_training_prediction_and_round_trip(tmp_path):
    model = tiny_bert(layers=2, heads=4, init_range=0.1)
    converted = batch_ensemble(model, 2, init_std=0.2)
    data = [labelled(text_inputs(batch=8, tokens=6, seed=s), seed=s) for s in range(4)]
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    config = FineTuneConfig(epochs=6, lr=3e-3, precision="fp32", warmup=0.0)
    result = fine_tune(converted, data, val=data, config=config, progress=False)
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    changed = [k for k, v in converted.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.endswith(".r") for k in changed) and any(k.endswith(".s") for k in changed)
    save_member(converted, tmp_path / "be")
    loaded = load_member(tmp_path / "be")
    x = text_inputs(batch=3)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, converted.eval()(**x).logits)
    assert batch_ensemble_members(loaded) == 2


def test_refusals():
    converted = batch_ensemble(tiny_bert(), 2)
    with pytest.raises(TypeError, match=r"plain nn\.Linear"):
        he.prune(converted, he.HeadSet({0: [0]}))
    with pytest.raises(ValueError, match="already"):
        batch_ensemble(converted, 2)
    with pytest.raises(ValueError, match="at least one member"):
        batch_ensemble(tiny_bert(), 0)
