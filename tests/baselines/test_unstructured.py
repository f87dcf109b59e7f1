"""The unstructured baselines (OBA, Wanda): scores against an explicit computation (OBA against
the full Hessian of a tiny model), the matched budget, masks that survive fine-tuning, and a
save/load round trip."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import hydra_ensembles as he
from hydra_ensembles.baselines.unstructured import (
    input_norms,
    make_permanent,
    matched_sparsity,
    oba_masks,
    oba_scores,
    prunable_linears,
    taylor_loss_change,
    unstructured_prune,
    wanda_masks,
)
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import FineTuneConfig, fine_tune
from tests.factories import FAMILIES, labelled

# one pytest-xdist worker: the explicit Hessians are computed once for the tests that share them
pytestmark = pytest.mark.xdist_group("unstructured")


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


@pytest.mark.parametrize("method", ["wanda", "oba"])
def test_matched_budget_masks_survive_fine_tuning_and_round_trip(tmp_path, method):
    model, calib = _setup()
    member = he.prune(model, he.HeadSet({0: [0, 1], 1: [1, 2, 3]}))
    sparsity = matched_sparsity(model, member)
    removed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in member.parameters())
    pruned = unstructured_prune(model, calib, sparsity, method)
    zeros = sum(int((m.weight == 0).sum()) for m in prunable_linears(pruned).values())
    rows = sum(m.out_features for m in prunable_linears(model).values())
    assert abs(zeros - removed) <= (rows if method == "wanda" else 0)  # Wanda rounds per row
    config = FineTuneConfig(epochs=2, lr=1e-2, precision="fp32", warmup=0.0)
    fine_tune(pruned, calib, None, config, progress=False)
    make_permanent(pruned)
    assert sum(int((m.weight == 0).sum()) for m in prunable_linears(pruned).values()) >= zeros
    save_member(pruned, tmp_path / method)
    x = {k: v for k, v in calib[0].items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(load_member(tmp_path / method)(**x).logits, pruned.eval()(**x).logits)
    with pytest.raises(ValueError, match="sparsity"):
        unstructured_prune(model, calib, 1.0, method)


# --- OBA ------------------------------------------------------------------------------------------


def _tiny(family="bert", seed=0):
    """A model whose prunable weights are a few hundred (272 for BERT), and three batches."""
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=2, head_dim=2, init_range=0.3, seed=seed)
    return model, [labelled(inputs(batch=3 + s, seed=s), seed=s) for s in range(3)]


def _explicit_terms(model, calib):
    """The gradient and the full Hessian of the mean cross-entropy over every calibration example,
    with respect to the flattened prunable weights (torch.autograd.functional.hessian)."""
    linears = prunable_linears(model)
    names = [f"{path}.weight" for path in linears]
    shapes = [linears[p].weight.shape for p in linears]
    flat = torch.cat([linears[p].weight.detach().flatten() for p in linears]).double()
    model = copy.deepcopy(model).double()
    examples = sum(len(b["labels"]) for b in calib)

    def loss(theta):
        params = dict(zip(names, torch.split(theta, [s.numel() for s in shapes]), strict=True))
        params = {n: t.view(s) for (n, t), s in zip(params.items(), shapes, strict=True)}
        total = 0.0
        for batch in calib:
            x = {k: v for k, v in batch.items() if k != "labels"}
            logits = functional_call(model, params, args=(), kwargs=x).logits
            total = total + F.cross_entropy(logits, batch["labels"], reduction="sum")
        return total / examples

    with sdpa_kernel(SDPBackend.MATH):
        grad = torch.autograd.functional.jacobian(loss, flat)
        hessian = torch.autograd.functional.hessian(loss, flat)
    return linears, flat, grad, hessian, loss


@functools.cache
def _explicit_terms_of_tiny(family: str) -> tuple:
    """`_explicit_terms` of ``_tiny(family)`` (its weights' paths, the weights, the gradient and
    the Hessian), computed once for both orders of the test below."""
    linears, theta, grad, hessian, _ = _explicit_terms(*_tiny(family))
    return list(linears), theta, grad, hessian


@pytest.mark.parametrize("family", ["bert", "vit"])
@pytest.mark.parametrize("first_order", [True, False])
def test_oba_scores_in_fp32_equal_the_formula_written_out_with_the_explicit_hessian(family, first_order):
    model, calib = _tiny(family)
    scores = oba_scores(model, calib, first_order=first_order)
    linears, theta, grad, hessian = _explicit_terms_of_tiny(family)
    assert hessian.shape == (272, 272) if family == "bert" else hessian.shape[0] > 100
    delta = -theta
    expected = 0.5 * delta * (hessian @ delta) + (delta * grad if first_order else 0)
    ours = torch.cat([scores[p].flatten() for p in linears])
    assert ours.dtype == torch.float64
    # the library runs the model in float32: agreement to float32 rounding of the products
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-6 * expected.abs().max().item())
    assert (expected.abs() > 1e-3 * expected.abs().max()).float().mean() > 0.5  # not all ~0


def test_removing_the_lowest_scored_weights_costs_what_the_fp32_taylor_estimate_predicts():
    model, calib = _tiny("bert", seed=1)
    linears, theta, _, _, loss = _explicit_terms(model, calib)
    base = loss(theta).item()
    masks = oba_masks(model, calib, 0.1)
    predicted = taylor_loss_change(model, calib, masks)
    keep = torch.cat([masks[p].flatten() for p in linears]).double()
    actual = loss(theta * keep).item() - base
    assert int((keep == 0).sum()) == round(0.1 * theta.numel())
    # third-order terms of a 10% removal: a small share of the change
    assert abs(actual - predicted) <= 0.02 * abs(actual)
    assert abs(actual) > 1e-5
    # every weight removed: the sum of the OBA scores is the Taylor estimate of that removal
    everything = {p: torch.zeros_like(m) for p, m in masks.items()}
    total = sum(s.sum() for s in oba_scores(model, calib).values()).item()
    assert total == pytest.approx(taylor_loss_change(model, calib, everything), rel=1e-6)


def test_oba_masks_rank_by_normalised_fp32_score_plus_magnitude_over_all_layers():
    model, calib = _tiny("bert")
    scores = oba_scores(model, calib)
    masks = oba_masks(model, calib, 0.4)
    importance = torch.cat(
        [
            (scores[p].abs() / scores[p].abs().max() + m.weight.detach().double().abs()).flatten()
            for p, m in prunable_linears(model).items()
        ]
    )
    keep = torch.cat([masks[p].flatten() for p in scores]).bool()
    assert int((~keep).sum()) == round(0.4 * keep.numel())
    assert importance[~keep].max() <= importance[keep].min()
    per_layer = [float(1 - masks[p].mean()) for p in masks]
    assert max(per_layer) > min(per_layer)  # one global threshold, not a share per layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_low_precision_model_is_scored_on_a_float32_copy_of_its_weights(dtype):
    model, calib = _tiny("bert")
    low = model.to(dtype)
    reference = oba_scores(low.float(), calib)
    low = low.to(dtype)
    flags = {n: p.requires_grad for n, p in low.named_parameters()}
    with torch.no_grad():  # scoring differentiates whatever the caller's grad mode
        scores = oba_scores(low, calib)
    with torch.inference_mode():  # batches made in inference mode too
        again = oba_scores(low, [{k: v.clone() for k, v in b.items()} for b in calib])
    for path, s in scores.items():
        assert torch.equal(s, reference[path]) and torch.equal(again[path], s)
    assert all(p.dtype == dtype for p in low.parameters())
    assert flags == {n: p.requires_grad for n, p in low.named_parameters()}


def test_oba_refuses_what_it_cannot_score():
    model, calib = _tiny("bert")
    with pytest.raises(ValueError, match="calib is empty"):
        oba_scores(model, [])
    with pytest.raises(ValueError, match="labels"):
        oba_scores(model, [{k: v for k, v in calib[0].items() if k != "labels"}])
    broken = next(iter(prunable_linears(model).values()))
    with torch.no_grad():
        broken.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite|NaN"):
        oba_scores(model, calib)
    with pytest.raises(ValueError, match="unknown unstructured method"):
        unstructured_prune(model, calib, 0.1, "magnitude")
    masked = unstructured_prune(_tiny("bert")[0], calib, 0.1, "wanda")
    with pytest.raises(ValueError, match="make_permanent"):
        oba_scores(masked, calib)
    assert oba_scores(make_permanent(masked), calib)
