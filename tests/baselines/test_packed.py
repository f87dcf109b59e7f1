"""Packed-Ensembles: the packed model computes exactly what its M narrow members compute one by
one, in every family; from_base starts each member from the base model; training, prediction and
save/load treat it as any ensemble."""

import pytest
import torch

from hydra_ensembles.baselines.packed import packed_ensemble, packed_member, packed_members
from hydra_ensembles.evaluation import predict
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import PARTS, FineTuneConfig, fine_tune
from tests.factories import FAMILIES, PRECISIONS, computing_in, labelled, rounding_tolerance

FAMILIES_PACKED = ["bert", "roberta", "electra", "distilbert", "vit", "deit", "dinov2"]


def _model(family: str):
    factory, inputs = FAMILIES[family]
    if family == "bert":  # an MLP width that splits into 4 groups at alpha=2 (the others' is 2d+1)
        return factory(layers=2, heads=4, head_dim=3, init_range=0.3, intermediate=24), inputs
    return factory(layers=2, heads=4, head_dim=3, init_range=0.3), inputs


PACKINGS = [(f, 2, 2, 1) for f in FAMILIES_PACKED] + [(f, 3, 3, 1) for f in FAMILIES_PACKED]


@pytest.mark.parametrize(
    ("family", "members", "alpha", "gamma"), [*PACKINGS, ("bert", 2, 2, 2), ("dinov2", 2, 2, 2)]
)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_packed_equals_its_members_one_by_one(family, members, alpha, gamma, precision):
    model, inputs = _model(family)
    packed = packed_ensemble(model, members, alpha, gamma, seed=1)
    assert packed_members(packed) == members and packed_members(model) == 1
    x = inputs(batch=4)
    preds = predict(packed, [labelled(x)], progress=False, precision=precision)
    assert preds.member_logits.shape == (members, 4, 3)
    with torch.no_grad(), computing_in(precision):
        one_by_one = torch.stack([packed_member(packed, m)(**x).logits.float() for m in range(members)])
    tol = rounding_tolerance(precision, one_by_one, layers=2, fp32=1e-5)
    assert (torch.as_tensor(preds.member_logits) - one_by_one).abs().max() <= tol
    assert not torch.allclose(one_by_one[0], one_by_one[1])  # members are different networks


@pytest.mark.parametrize("family", ["bert", "distilbert", "dinov2"])
def test_from_base_starts_every_member_from_the_base_backbone(family):
    model, _ = _model(family)
    packed = packed_ensemble(model, 3, alpha=3, from_base=True)
    base = model.state_dict()
    heads = ("classifier", "pre_classifier")
    for m in range(3):
        member = packed_member(packed, m).state_dict()
        assert all(torch.equal(member[k], base[k]) for k in base if not k.startswith(heads))
    with pytest.raises(ValueError, match="alpha == M"):
        packed_ensemble(model, 3, alpha=2, from_base=True)


def test_training_and_round_trip(tmp_path):
    model, inputs = _model("dinov2")
    packed = packed_ensemble(model, 2, alpha=2, gamma=2)
    data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(3)]
    before = {n: p.clone() for n, p in packed.named_parameters()}
    fine_tune(
        packed,
        data,
        None,
        FineTuneConfig(epochs=1, lr=1e-2, precision="fp32", warmup=0.0, trainable=PARTS),
        progress=False,
    )
    moved = {n for n, p in packed.named_parameters() if not torch.equal(p, before[n])}
    assert moved >= {n for n, p in packed.named_parameters() if p.dim() > 1 and "mask_token" not in n}
    save_member(packed, tmp_path / "packed")
    loaded = load_member(tmp_path / "packed")
    assert packed_members(loaded) == 2
    x = inputs(batch=3)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, packed.eval()(**x).logits)


def test_bad_packings_are_refused():
    model, _ = _model("bert")
    with pytest.raises(ValueError, match="heads cannot be shared"):
        packed_ensemble(model, 3, alpha=2)  # 8 heads for 3 members
    with pytest.raises(ValueError, match="families"):
        packed_ensemble(FAMILIES["clip"][0](), 2)
    with pytest.raises(ValueError, match="already"):
        packed_ensemble(packed_ensemble(model, 2), 2)
