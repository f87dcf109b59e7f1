"""The one ensemble output contract: every wrapper against explicit computation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import hydra_ensembles as he
from hydra_ensembles.baselines import batch_ensemble
from hydra_ensembles.members import DeepEnsemble, MCDropout, StackedMembers, as_ensemble
from hydra_ensembles.outputs import EnsembleOutput, ensemble_nll
from tests.factories import text_inputs, tiny_bert


def _members():
    base = tiny_bert(init_range=0.5)
    return [he.prune(base, he.HeadSet({0: [m, (m + 1) % 4], 1: [m]})).eval() for m in range(3)]


def test_deep_ensemble_is_the_mean_of_member_softmaxes_and_its_nll():
    members, x = _members(), text_inputs()
    labels = torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        out = DeepEnsemble(members)(**x, labels=labels)
        logits = torch.stack([m(**x).logits for m in members])
    assert torch.equal(out.member_logits, logits)
    probs = logits.softmax(-1).mean(0)
    assert torch.allclose(out.probs, probs, atol=1e-6)
    assert torch.allclose(out.loss, F.nll_loss(probs.log(), labels), atol=1e-6)


def test_ensemble_nll_is_exact_where_clamping_would_not_be():
    logits = torch.tensor([[[200.0, 0.0]], [[300.0, 0.0]]], dtype=torch.float64)  # p(class 1) ~ e^-200
    nll = ensemble_nll(logits, torch.tensor([1]))
    assert torch.isclose(nll, torch.tensor(200.0 - torch.log(torch.tensor(0.5)).item(), dtype=torch.float64))
    assert nll > -torch.log(torch.tensor(1e-12, dtype=torch.float64))  # a clamp at 1e-12 would cap it


def test_deep_ensemble_round_trip_and_a_missing_index_or_tampered_member(tmp_path):
    members, x = _members(), text_inputs()
    DeepEnsemble(members).save_pretrained(tmp_path / "ens")
    loaded = DeepEnsemble.from_pretrained(tmp_path / "ens").eval()
    with torch.no_grad():
        assert torch.equal(loaded(**x).member_logits, DeepEnsemble(members)(**x).member_logits)
    config = tmp_path / "ens" / "member-1" / "member_config.json"
    meta = json.loads(config.read_text())
    meta["config"]["hidden_dropout_prob"] = 0.5
    config.write_text(json.dumps(meta))
    with pytest.raises(he.MemberLoadError, match="modified"):
        DeepEnsemble.from_pretrained(tmp_path / "ens")
    (tmp_path / "ens" / "ensemble_config.json").unlink()
    with pytest.raises(he.MemberLoadError, match="not a saved ensemble"):
        DeepEnsemble.from_pretrained(tmp_path / "ens")


def test_mc_dropout_samples_with_dropout_and_restores_the_mode():
    model, x = tiny_bert(dropout=0.3).eval(), text_inputs()
    with torch.no_grad():
        out = MCDropout(model, 4)(**x)
    assert out.member_logits.shape[0] == 4 and not model.training
    assert not torch.equal(out.member_logits[0], out.member_logits[1])


@pytest.mark.parametrize(("family", "dropout"), [("bert", True), ("dinov2", False), ("clip", False)])
def test_mc_dropout_refuses_a_model_without_dropout(family, dropout):
    """DINOv2 (and CLIP by default) have no dropout: their "samples" would be one model M times,
    a silently wrong row."""
    from hydra_ensembles.members.ensemble import has_dropout
    from tests.factories import FAMILIES

    model = FAMILIES[family][0]()
    assert has_dropout(model) == dropout
    if not dropout:
        with pytest.raises(ValueError, match="has none with p > 0"):
            MCDropout(model, 2)
    assert not has_dropout(tiny_bert(dropout=0.0))


def test_batch_ensemble_rows_become_members():
    model, x = batch_ensemble(tiny_bert(), 3, init_std=0.3).eval(), text_inputs()
    wrapped = as_ensemble(model)
    assert isinstance(wrapped, StackedMembers) and wrapped.num_members == 3
    with torch.no_grad():
        out, raw = wrapped(**x), model(**x).logits
    assert torch.equal(out.member_logits, raw.view(3, 4, -1))


def test_as_ensemble_dispatch():
    members = _members()
    hydra = he.fuse(members)
    assert as_ensemble(hydra) is hydra
    assert isinstance(as_ensemble(members), DeepEnsemble) and as_ensemble(members).num_members == 3
    single = as_ensemble(members[0])
    assert isinstance(single, DeepEnsemble) and single.num_members == 1
    assert isinstance(as_ensemble(members[0], mc_samples=2), MCDropout)
    with pytest.raises(ValueError, match="MC dropout"):
        as_ensemble(members, mc_samples=2)
    with pytest.raises(ValueError, match="MC dropout"):
        as_ensemble(hydra, mc_samples=2)
    with torch.no_grad():
        assert isinstance(hydra(**text_inputs()), EnsembleOutput)


def test_auto_member_loads_a_saved_pruned_member_as_its_own_class(tmp_path):
    model, x = tiny_bert(), text_inputs()
    member = he.prune(model, he.HeadSet({0: [1, 3], 1: [0]}))
    he.AutoMember.save_pretrained(member, tmp_path / "member")
    loaded = he.AutoMember.from_pretrained(tmp_path / "member")
    assert type(loaded) is type(member) and he.kept_heads(loaded) == he.kept_heads(member)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, member.eval()(**x).logits)
    (tmp_path / "member" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(he.MemberLoadError):
        he.AutoMember.from_pretrained(tmp_path / "member")
    with pytest.raises(TypeError, match="from_pretrained"):
        he.AutoMember()
