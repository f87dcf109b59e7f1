"""Shared trunk: leading layers where members agree run once; outputs stay exact."""

import pytest
import torch

import hydra_ensembles as he
from tests.factories import image_inputs, text_inputs, tiny_bert, tiny_vit

TOL = 1e-4
SHARED = {0: [0, 2], 1: [1, 2, 3]}
HEADS = [
    he.HeadSet({**SHARED, 2: [0], 3: [1, 2]}),
    he.HeadSet({**SHARED, 2: [1, 3], 3: []}),
    he.HeadSet({**SHARED, 2: [0, 1, 2]}),
]


def _explicit(model, heads, x):
    with torch.no_grad():
        return torch.stack([he.prune(model, hs)(**x).logits for hs in heads])


@pytest.mark.parametrize(("factory", "inputs"), [(tiny_bert, text_inputs), (tiny_vit, image_inputs)])
def test_zero_shot_trunk_is_detected_and_exact(factory, inputs):
    model = factory(layers=4, heads=4, head_dim=3, init_range=0.2)
    x = inputs()
    hydra = he.fuse(model, HEADS).eval()
    assert hydra.trunk_layers == 2
    with torch.no_grad():
        out = hydra(**x)
        plain = he.fuse(model, HEADS, shared_trunk=False).eval()(**x)
    assert (out.member_logits - _explicit(model, HEADS, x)).abs().max().item() <= TOL
    assert (out.member_logits - plain.member_logits).abs().max().item() <= TOL
    assert he.fuse(model, HEADS, shared_trunk=False).trunk_layers == 0


def test_trunk_layers_run_on_the_input_rows_only(monkeypatch):
    model = tiny_bert(layers=4, heads=4, head_dim=3)
    hydra = he.fuse(model, HEADS).eval()
    rows = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, *a, **k: rows.append(q.shape[0]) or original(q, *a, **k),
    )
    with torch.no_grad():
        hydra(**text_inputs(batch=5))
    assert rows == [5, 5, 15, 15]


def test_fine_tuned_members_share_a_trunk_only_where_weights_agree():
    model = tiny_bert(layers=4, heads=4, head_dim=3, init_range=0.2)
    members = [he.prune(model, hs) for hs in HEADS]
    for i, member in enumerate(members):  # fine-tuning touched only the last two layers
        with torch.no_grad():
            for name, p in member.named_parameters():
                if ".layer.2." in name or ".layer.3." in name or name.startswith("classifier"):
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    x = text_inputs()
    hydra = he.fuse(members, mlp="exact").eval()
    assert hydra.trunk_layers == 2
    with torch.no_grad():
        explicit = torch.stack([m.eval()(**x).logits for m in members])
        assert (hydra(**x).member_logits - explicit).abs().max().item() <= TOL
    with torch.no_grad():
        members[1].bert.encoder.layer[0].attention.self.query.weight.add_(0.01)
    assert he.fuse(members, mlp="exact").trunk_layers == 0


def test_trunk_round_trip(tmp_path):
    model = tiny_bert(layers=4, heads=4, head_dim=3)
    hydra = he.fuse(model, HEADS).eval()
    hydra.save_pretrained(tmp_path)
    loaded = he.load_hydra(tmp_path)
    x = text_inputs()
    assert loaded.trunk_layers == 2
    with torch.no_grad():
        assert torch.equal(hydra(**x).member_logits, loaded(**x).member_logits)


def test_sample_members_with_shared_layers():
    order = he.CircuitOrder(
        "avg", [4, 4, 4], 1.0, [(0, 1), (1, 2), (2, 0), (0, 3), (2, 2), (1, 0)], [1.0] * 6
    )
    members = he.sample_members(order, 3, num_pruned=3, pool_size=6, seed=0, shared_layers=2)
    first = [hs.resolve([4, 4, 4]) for hs in members]
    assert all(f[:2] == first[0][:2] for f in first)
    with pytest.raises(ValueError, match="shared_layers"):
        he.sample_members(order, 2, num_pruned=2, shared_layers=4)
