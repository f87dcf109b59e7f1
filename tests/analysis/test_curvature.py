"""Proposition 1's estimators against exact computation on a tiny model: the full Hessian of the
attention parameters from `torch.autograd.functional.hessian`, gradients from a functional call,
and the pruning perturbation against structural pruning."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

import hydra_ensembles as he
from hydra_ensembles.analysis import (
    attention_parameters,
    gradient,
    hessian_vector_products,
    hutchinson_diagonal,
    proposition1,
    pruning_perturbation,
)
from tests.factories import decoder_inputs, labelled, text_inputs, tiny_bert, tiny_decoder

HEADS = he.HeadSet({0: [1], 1: [0, 1]})

# one pytest-xdist worker: the exact Hessians are computed once for the tests that share them
pytestmark = pytest.mark.xdist_group("curvature")


@pytest.fixture(scope="module")
def setup():
    model = tiny_bert(layers=2, heads=2, head_dim=2, init_range=0.5, dropout=0.0)
    with torch.no_grad():  # BERT starts its biases at zero: give them values to prune
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    clean = [labelled(text_inputs(4, 6, seed=s), seed=s) for s in range(2)]
    noisy = [labelled(text_inputs(5, 6, seed=10), seed=10)]
    return model, clean, noisy


def _exact(model, batches):
    """Gradient and full Hessian of the mean loss in the attention parameters (flattened)."""
    params = attention_parameters(model)
    names = {id(p): n for n, p in model.named_parameters()}
    keys = [names[id(p)] for p in params.values()]
    shapes = [p.shape for p in params.values()]
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])

    def loss(vector):
        tensors, start = {}, 0
        for key, shape in zip(keys, shapes, strict=True):
            tensors[key] = vector[start : start + shape.numel()].view(shape)
            start += shape.numel()
        total = 0.0
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            logits = functional_call(model, tensors, kwargs=inputs).logits
            total = total + F.cross_entropy(logits, batch["labels"]) / len(batches)
        return total

    with sdpa_kernel(SDPBackend.MATH):
        grad = torch.autograd.functional.jacobian(loss, flat)
        hessian = torch.autograd.functional.hessian(loss, flat)
    return grad, hessian


@pytest.fixture(scope="module")
def exact_terms(setup):
    """`_exact` of the clean or the noisy batches, each computed once for the module's tests."""
    model, clean, noisy = setup
    batches = {"clean": clean, "noisy": noisy}
    return functools.cache(lambda name: _exact(model, batches[name]))


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def test_gradient_and_hessian_vector_products_equal_the_exact_ones(setup, exact_terms):
    model, clean, _ = setup
    grad, hessian = exact_terms("clean")
    params = list(attention_parameters(model).values())
    assert torch.allclose(_flat(gradient(model, clean, params)), grad, atol=1e-6)
    vectors = [[torch.randn_like(p) for p in params] for _ in range(2)]
    for vector, product in zip(vectors, hessian_vector_products(model, clean, params, vectors), strict=True):
        assert torch.allclose(_flat(product), hessian @ _flat(vector), atol=1e-5)
    assert all(p.requires_grad for p in model.parameters())  # the caller's flags are restored


def test_hutchinson_diagonal_is_within_its_standard_error_of_the_exact_diagonal(setup, exact_terms):
    model, clean, _ = setup
    _, hessian = exact_terms("clean")
    params = list(attention_parameters(model).values())
    estimate, stderr = hutchinson_diagonal(model, clean, params, probes=150, seed=1)
    estimate, stderr, exact = _flat(estimate), _flat(stderr), hessian.diagonal()
    off_diagonal = hessian - torch.diag(exact)
    assert off_diagonal.abs().max() > 10 * exact.abs().max() / 100  # the probes have noise to average
    assert ((estimate - exact).abs() <= 5 * stderr + 1e-7).all()
    assert (estimate - exact).abs().mean() < 0.2 * (off_diagonal.abs().sum(1)).mean()


def test_pruning_perturbation_moves_the_weights_to_the_pruned_model(setup):
    model, clean, _ = setup
    delta = pruning_perturbation(model, HEADS)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for param, change in zip(attention_parameters(moved).values(), delta.values(), strict=True):
            param.add_(change)
        inputs = {k: v for k, v in clean[0].items() if k != "labels"}
        assert torch.allclose(moved(**inputs).logits, he.prune(model, HEADS)(**inputs).logits, atol=1e-6)
    # one head of 2 dimensions removed (hidden 4): its Q/K/V rows and biases, its W_O columns
    assert sum(int((d != 0).sum()) for d in delta.values()) == 3 * (2 * 4 + 2) + 4 * 2


def test_pruning_perturbation_of_grouped_query_attention_removes_whole_groups_only():
    model = tiny_decoder("llama", layers=2, heads=4, head_dim=2, init_range=0.3)
    heads = he.HeadSet({0: [0, 2], 1: [2, 3]})  # layer 0: both key/value heads read; layer 1: one
    delta = pruning_perturbation(model, heads)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for param, change in zip(attention_parameters(moved).values(), delta.values(), strict=True):
            param.add_(change)
        x = decoder_inputs(3, 6)
        assert torch.allclose(moved(**x).logits, he.prune(model, heads)(**x).logits, atol=1e-6)
    assert int((delta["0.k.weight"] != 0).any(1).sum()) == 0  # no key/value row of layer 0 goes
    assert int((delta["1.v.weight"] != 0).any(1).sum()) == 2  # key/value head 0 of layer 1 does


def test_proposition1_equals_its_exact_quantities(setup, exact_terms):
    model, clean, noisy = setup
    result = proposition1(model, clean, noisy, HEADS, probes=100, seed=2)
    delta = _flat(pruning_perturbation(model, HEADS).values())
    (grad_t, hess_t), (grad_n, hess_n) = exact_terms("clean"), exact_terms("noisy")
    assert result.alignment_noisy == pytest.approx(float(grad_n @ delta), rel=1e-4, abs=1e-7)
    assert result.alignment_clean == pytest.approx(float(grad_t @ delta), rel=1e-4, abs=1e-7)
    curvature = 0.5 * float(delta @ (hess_n - hess_t) @ delta)
    assert result.curvature_gap == pytest.approx(curvature, rel=1e-4, abs=1e-7)
    support = delta != 0
    diagonal = float((hess_n - hess_t).diagonal()[support].mean())
    assert abs(result.diagonal_gap - diagonal) <= 5 * result.diagonal_gap_stderr
    assert result.heads_removed == 1 and result.probes == 100
    with torch.no_grad(), he.ablate(model, HEADS):
        pruned_t = sum(model(**b).loss for b in clean) / len(clean)
        pruned_n = model(**noisy[0]).loss
    with torch.no_grad():
        gap = float(model(**noisy[0]).loss - sum(model(**b).loss for b in clean) / len(clean))
    assert result.measured_gap_change == pytest.approx(float(pruned_n - pruned_t) - gap, abs=1e-5)
    assert result.predicted_gap_change == pytest.approx(
        result.alignment_noisy - result.alignment_clean + result.curvature_gap
    )


def test_several_head_sets_share_probes_and_give_each_its_own_result(setup):
    model, clean, noisy = setup
    other = he.HeadSet({0: [0, 1], 1: [1]})
    both = proposition1(model, clean, noisy, {"a": HEADS, "b": other}, probes=4, seed=5)
    alone = proposition1(model, clean, noisy, other, probes=4, seed=5)
    assert both["b"] == alone and both["a"] != both["b"]


def test_proposition1_refuses_a_head_set_that_removes_nothing(setup):
    model, clean, noisy = setup
    with pytest.raises(ValueError, match="removes no head"):
        proposition1(model, clean, noisy, he.HeadSet.full([2, 2]), probes=2)
    with pytest.raises(ValueError, match="probes must be at least 2"):
        proposition1(model, clean, noisy, HEADS, probes=1)
    with pytest.raises(ValueError, match="probes must be at least 2"):
        hutchinson_diagonal(model, clean, list(attention_parameters(model).values()), probes=1)
