"""Structural pruning equals masking; ablation is reversible; inputs are never modified."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hydra_ensembles as he
from hydra_ensembles.hashing import fingerprint
from tests.factories import image_inputs, text_inputs, tiny_bert, tiny_vit

TOL = 1e-5


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@st.composite
def model_and_heads(draw, family):
    layers = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([1, 2, 3, 5, 7]))
    seed = draw(st.integers(0, 2**16))
    kept = {
        layer: draw(st.lists(st.integers(0, heads - 1), unique=True, max_size=heads))
        for layer in range(layers)
        if draw(st.booleans())
    }
    factory = tiny_bert if family == "bert" else tiny_vit
    return factory(layers=layers, heads=heads, head_dim=head_dim, seed=seed), he.HeadSet(kept)


def _assert_prune_equals_mask(model, heads, inputs):
    before = fingerprint(model)
    pruned = he.prune(model, heads)
    with he.ablate(model, heads):
        masked = _logits(model, inputs)
    assert (_logits(pruned, inputs) - masked).abs().max().item() <= TOL
    assert type(pruned) is type(model)
    assert fingerprint(model) == before, "prune must not modify its input"
    assert he.kept_heads(pruned) == he.HeadSet(
        dict(enumerate(heads.resolve(he.get_adapter(model).original_heads_per_layer(model))))
    )


@settings(max_examples=30, deadline=None)
@given(model_and_heads("bert"), st.integers(0, 100))
def test_bert_pruning_equals_masking(case, seed):
    model, heads = case
    _assert_prune_equals_mask(model, heads, text_inputs(batch=3, tokens=7, seed=seed))


@settings(max_examples=20, deadline=None)
@given(model_and_heads("vit"), st.integers(0, 100))
def test_vit_pruning_equals_masking(case, seed):
    model, heads = case
    _assert_prune_equals_mask(model, heads, image_inputs(batch=2, seed=seed))


def test_real_minilm_pruning_equals_masking(minilm, minilm_inputs):
    heads = he.HeadSet({0: [0, 1, 2, 3, 4, 5, 6, 7], 2: [11], 3: [], 5: [1, 3, 5, 7, 9, 11]})
    _assert_prune_equals_mask(minilm, heads, minilm_inputs)


def test_pruned_shapes_and_parameter_count():
    model = tiny_bert(layers=2, heads=4, head_dim=3)
    pruned = he.prune(model, he.HeadSet({0: [1, 3], 1: []}))
    block0 = he.get_adapter(pruned).attention_block(pruned, 0)
    assert block0.query.weight.shape == (6, 12) and block0.output.weight.shape == (12, 6)
    assert he.get_adapter(pruned).attention_block(pruned, 1).num_heads == 0
    removed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in pruned.parameters())
    # layer 0 loses 2 heads, layer 1 all 4: 6 heads x (3 rows + 3 bias) x Q,K,V + 6 heads x 3 W_O columns
    assert removed == 6 * 3 * (3 * (12 + 1) + 12)


def test_empty_layer_leaves_only_the_output_bias():
    model = tiny_bert(layers=1, heads=2, head_dim=2)
    pruned = he.prune(model, he.HeadSet({0: []}))
    layer = he.get_adapter(pruned).layers(pruned)[0]
    hidden = torch.randn(2, 5, 4)
    out, _ = layer.attention.self(hidden)
    assert out.shape == (2, 5, 0)
    assert torch.allclose(
        layer.attention.output.dense(out), layer.attention.output.dense.bias.expand(2, 5, 4)
    )


def test_pruning_a_pruned_model_uses_original_indices():
    model = tiny_bert(layers=2, heads=4)
    inputs = text_inputs()
    twice = he.prune(he.prune(model, he.HeadSet({0: [0, 2, 3]})), he.HeadSet({0: [2], 1: [1, 3]}))
    once = he.prune(model, he.HeadSet({0: [2], 1: [1, 3]}))
    assert torch.allclose(_logits(twice, inputs), _logits(once, inputs), atol=TOL)
    with pytest.raises(he.HeadSetError, match="already pruned"):
        he.prune(he.prune(model, he.HeadSet({0: [0]})), he.HeadSet({0: [1]}))


def test_ablation_is_reversible_and_copies_no_weights():
    model = tiny_bert()
    inputs = text_inputs()
    reference = _logits(model, inputs)
    pointers = [p.data_ptr() for p in model.parameters()]
    ablation = he.HeadAblation(model)
    assert torch.equal(_logits(model, inputs), reference)
    ablation.mask[0, 1] = 0.0  # in place: the next forward sees it
    changed = _logits(model, inputs)
    assert not torch.allclose(changed, reference)
    with he.ablate(model, he.HeadSet({0: [0, 2, 3]})):  # nests: masks multiply
        assert torch.allclose(_logits(model, inputs), changed, atol=1e-6)
    ablation.remove()
    assert torch.equal(_logits(model, inputs), reference)
    assert pointers == [p.data_ptr() for p in model.parameters()]


def test_ablation_mask_shape_is_checked():
    with pytest.raises(ValueError, match="mask must have shape"):
        he.HeadAblation(tiny_bert(layers=2, heads=4), torch.ones(3, 4))


def test_prune_refuses_bad_input():
    model = tiny_bert(layers=2, heads=4)
    with pytest.raises(he.HeadSetError, match="out of range"):
        he.prune(model, he.HeadSet({0: [4]}))
    with pytest.raises(TypeError, match="HeadSet"):
        he.prune(model, {0: [1]})
    with pytest.raises(he.UnsupportedModelError):
        he.prune(torch.nn.Linear(2, 2), he.HeadSet())


def test_fingerprint_cache_sees_every_write():
    model = tiny_bert()
    first = fingerprint(model)
    assert fingerprint(model) == first  # served from the cache
    weight = model.bert.encoder.layer[0].attention.self.query.weight
    with torch.no_grad():
        weight.mul_(2.0)  # in place: the version counter moves
    second = fingerprint(model)
    assert second != first
    with torch.no_grad():
        weight.div_(2.0)  # exact in floating point
    assert fingerprint(model) == first  # same bytes, same digest
    weight.data = weight.data.clone() * 3  # replaced storage
    assert fingerprint(model) not in (first, second)
    assert fingerprint(tiny_bert()) == first  # equal weights, another object: same digest
