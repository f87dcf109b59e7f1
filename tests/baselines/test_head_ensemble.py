"""Deep Ensembles (D): one backbone, M task heads; against explicit computation (the backbone's
head input fed to each head one by one), training touches only the heads, save/load round trip."""

import pytest
import torch

from hydra_ensembles.baselines import head_ensemble, head_ensemble_members, train_head_ensemble
from hydra_ensembles.baselines.head_ensemble import MemberHeads
from hydra_ensembles.evaluation import predict
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import FineTuneConfig
from tests.factories import FAMILIES, PRECISIONS, computing_in, labelled, rounding_tolerance


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "dinov2", "clip"])
def test_members_equal_the_backbone_with_each_head(family, precision):
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    ensemble = head_ensemble(model, 3, seed=5).eval()
    assert head_ensemble_members(ensemble) == 3 and head_ensemble_members(model) == 1
    x = inputs(batch=4)
    preds = predict(ensemble, [labelled(x)], progress=False, precision=precision)
    assert preds.member_logits.shape == (3, 4, 3)
    heads = {n: m.heads for n, m in ensemble.named_children() if isinstance(m, MemberHeads)}
    assert heads  # DistilBERT: pre_classifier and classifier, each per member
    expected = []
    with torch.no_grad(), computing_in(precision):
        for member in range(3):
            single = type(model)(model.config).eval()
            single.load_state_dict(model.state_dict())
            for name, copies in heads.items():
                setattr(single, name, copies[member])
            expected.append(single(**x).logits.float())
    expected = torch.stack(expected)
    tol = rounding_tolerance(precision, expected, layers=2, fp32=1e-5)
    assert (torch.as_tensor(preds.member_logits) - expected).abs().max() <= tol
    assert not torch.allclose(expected[0], expected[1])  # heads start from different seeds


def test_training_moves_only_the_heads_and_round_trips(tmp_path):
    factory, inputs = FAMILIES["bert"]
    ensemble = head_ensemble(factory(layers=2, heads=4, head_dim=3), 2)
    before = {n: p.clone() for n, p in ensemble.named_parameters()}
    data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(3)]
    config = FineTuneConfig(epochs=2, lr=1e-2, precision="fp32", warmup=0.0)
    train_head_ensemble(ensemble, data, config, progress=False)
    changed = {n for n, p in ensemble.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("classifier.heads.") for n in changed)
    assert all(p.requires_grad for p in ensemble.parameters())  # the caller's flags are back
    save_member(ensemble, tmp_path / "ded")
    loaded = load_member(tmp_path / "ded")
    x = inputs(batch=3)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, ensemble.eval()(**x).logits)
    with pytest.raises(ValueError, match="already"):
        head_ensemble(ensemble, 2)


def test_cached_head_training_equals_training_through_the_model():
    """Heads trained on the backbone's cached output take the same steps as heads trained with
    the whole model running each step (no dropout, so both see the same features)."""
    from hydra_ensembles.training import fine_tune

    factory, inputs = FAMILIES["bert"]
    model = factory(layers=2, heads=4, head_dim=3, dropout=0.0)
    data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(3)]
    config = FineTuneConfig(epochs=2, lr=1e-2, precision="fp32", warmup=0.0, trainable=None)
    cached, through = head_ensemble(model, 2), head_ensemble(model, 2)
    train_head_ensemble(cached, data, config, progress=False)
    for name, param in through.named_parameters():
        param.requires_grad_(name.startswith("classifier."))
    fine_tune(through, data, None, config, progress=False)
    for (name, a), b in zip(cached.named_parameters(), through.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_cached_head_training_stops_at_the_best_validation_nll():
    factory, inputs = FAMILIES["vit"]
    ensemble = head_ensemble(factory(layers=2, heads=4, head_dim=3), 2)
    data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(3)]
    val = [labelled(inputs(batch=4, seed=9), seed=9)]
    config = FineTuneConfig(epochs=40, lr=0.3, precision="fp32", warmup=0.0, patience=2)
    result = train_head_ensemble(ensemble, data, config, val=val, progress=False)
    nlls = [record["val_nll"] for record in result.history]
    assert result.stopped_early and len(nlls) < 40
    assert result.best_epoch == min(range(len(nlls)), key=nlls.__getitem__)
