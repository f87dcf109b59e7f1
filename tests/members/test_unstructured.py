"""The unstructured baseline (Wanda): scores against an explicit computation, the matched budget,
masks that survive fine-tuning, and a save/load round trip."""

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.members import FineTuneConfig, fine_tune, load_member, save_member
from hydra_ensembles.members.unstructured import (
    input_norms,
    make_permanent,
    matched_sparsity,
    prunable_linears,
    wanda_masks,
    wanda_prune,
)
from tests.factories import FAMILIES, labelled


def _setup(family="bert"):
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    return model, [labelled(inputs(batch=4, seed=s), seed=s) for s in range(2)]


def test_input_norms_equal_the_explicit_norm_of_each_layers_input():
    model, calib = _setup("vit")
    seen = []
    linears = prunable_linears(model)
    path, linear = next((p, m) for p, m in linears.items() if p.endswith("1.attention.q_proj"))
    handle = linear.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].reshape(-1, args[0].shape[-1]))
    )
    norms = input_norms(model, calib)
    handle.remove()
    torch.testing.assert_close(norms[path], torch.cat(seen).norm(dim=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "dinov2"])
def test_each_row_drops_its_least_important_weights(family):
    model, calib = _setup(family)
    norms = input_norms(model, calib)
    masks = wanda_masks(model, calib, 0.5)
    for path, linear in prunable_linears(model).items():
        mask = masks[path]
        assert (mask.sum(1) == linear.in_features - linear.in_features // 2).all()
        score = linear.weight.abs() * norms[path]
        kept_min = torch.where(mask.bool(), score, torch.inf).min(1).values
        dropped_max = torch.where(mask.bool(), -torch.inf, score).max(1).values
        assert (dropped_max <= kept_min).all()


def test_matched_budget_masks_survive_fine_tuning_and_round_trip(tmp_path):
    model, calib = _setup()
    member = he.prune(model, he.HeadSet({0: [0, 1], 1: [1, 2, 3]}))
    sparsity = matched_sparsity(model, member)
    removed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in member.parameters())
    pruned = wanda_prune(model, calib, sparsity)
    zeros = sum(int((m.weight == 0).sum()) for m in prunable_linears(pruned).values())
    rows = sum(m.out_features for m in prunable_linears(model).values())
    assert abs(zeros - removed) <= rows  # per-row rounding down
    config = FineTuneConfig(epochs=2, lr=1e-2, precision="fp32", warmup=0.0)
    fine_tune(pruned, calib, None, config, progress=False)
    make_permanent(pruned)
    assert sum(int((m.weight == 0).sum()) for m in prunable_linears(pruned).values()) >= zeros
    save_member(pruned, tmp_path / "wanda")
    x = {k: v for k, v in calib[0].items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(load_member(tmp_path / "wanda")(**x).logits, pruned.eval()(**x).logits)
    with pytest.raises(ValueError, match="sparsity"):
        wanda_masks(model, calib, 1.0)
