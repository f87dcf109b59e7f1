"""The fused model equals the explicit ensemble (pruned members run one by one), in float32."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hydra_ensembles as he
from hydra_ensembles.layers import FusedMultiHeadAttention, GroupedLinear
from tests.factories import image_inputs, text_inputs, tiny_bert, tiny_vit

TOL = 1e-4


def _member_logits(members, inputs):
    with torch.no_grad():
        return torch.stack([m.eval()(**inputs).logits for m in members])


@st.composite
def ensembles(draw, family):
    """A random tiny model and M ragged head sets, including a member with an empty layer and
    members sharing heads."""
    layers = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([1, 3, 5, 7]))
    num_members = draw(st.integers(1, 5))
    head_lists = st.lists(st.integers(0, heads - 1), unique=True, max_size=heads)
    head_sets = [
        {layer: draw(head_lists) for layer in range(layers) if draw(st.booleans())}
        for _ in range(num_members)
    ]
    head_sets[0][draw(st.integers(0, layers - 1))] = []  # some member has an empty layer
    if num_members > 1:
        head_sets[-1] = dict(head_sets[-2])  # two members share all heads
    factory = tiny_bert if family == "bert" else tiny_vit
    model = factory(layers=layers, heads=heads, head_dim=head_dim, seed=draw(st.integers(0, 999)))
    return model, [he.HeadSet(hs) for hs in head_sets]


@settings(max_examples=40, deadline=None)
@given(ensembles("bert"), st.integers(1, 5), st.integers(2, 11), st.integers(0, 99))
def test_zero_shot_fusion_is_exact_bert_padded(case, batch, tokens, seed):
    model, head_sets = case
    inputs = text_inputs(batch=batch, tokens=tokens, seed=seed, padded=True)
    hydra = he.fuse(model, head_sets).eval()
    with torch.no_grad():
        out = hydra(**inputs)
    expected = _member_logits([he.prune(model, hs) for hs in head_sets], inputs)
    assert out.member_logits.shape == expected.shape
    assert (out.member_logits - expected).abs().max().item() <= TOL
    assert torch.allclose(out.probs, expected.softmax(-1).mean(0), atol=TOL)


@settings(max_examples=25, deadline=None)
@given(ensembles("vit"), st.integers(1, 4), st.integers(0, 99))
def test_zero_shot_fusion_is_exact_vit(case, batch, seed):
    model, head_sets = case
    inputs = image_inputs(batch=batch, seed=seed)
    with torch.no_grad():
        out = he.fuse(model, head_sets).eval()(**inputs)
    expected = _member_logits([he.prune(model, hs) for hs in head_sets], inputs)
    assert (out.member_logits - expected).abs().max().item() <= TOL


def test_fusion_of_real_minilm(minilm, minilm_inputs):
    head_sets = [
        he.HeadSet({layer: [(layer + m + i) % 12 for i in range(8)] for layer in range(6)}) for m in range(3)
    ]
    with torch.no_grad():
        out = he.fuse(minilm, head_sets).eval()(**minilm_inputs)
    expected = _member_logits([he.prune(minilm, hs) for hs in head_sets], minilm_inputs)
    assert (out.member_logits - expected).abs().max().item() <= TOL


def test_ensemble_prediction_is_the_mean_of_member_softmaxes():
    # strongly different, confident members, so the two kinds of average differ visibly
    members = _perturbed_members(tiny_bert(), [he.HeadSet({0: [0]}), he.HeadSet({1: [1, 2]})], scale=0.5)
    hydra = he.fuse(members, mlp="exact").eval()
    with torch.no_grad():
        out = hydra(**text_inputs(), labels=torch.tensor([0, 1, 2, 0]))
    assert out.probs.shape == (4, 3)
    assert torch.allclose(out.probs, out.member_logits.softmax(-1).mean(0))
    assert not torch.allclose(out.probs, out.member_logits.mean(0).softmax(-1))
    assert torch.allclose(out.probs.sum(-1), torch.ones(4))
    expected_loss = torch.nn.functional.nll_loss(out.probs.log(), torch.tensor([0, 1, 2, 0]))
    assert torch.allclose(out.loss, expected_loss)


def _perturbed_members(model, head_sets, scale=0.05):
    members = []
    for i, hs in enumerate(head_sets):
        member = he.prune(model, hs)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in member.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))
        members.append(member.eval())
    return members


MEMBER_HEADS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({1: [3]})]


@pytest.mark.parametrize(("factory", "inputs"), [(tiny_bert, text_inputs), (tiny_vit, image_inputs)])
def test_exact_mode_reproduces_the_explicit_ensemble(factory, inputs):
    members = _perturbed_members(factory(layers=2, heads=4, head_dim=3), MEMBER_HEADS)
    x = inputs()
    hydra = he.fuse(members, mlp="exact").eval()
    with torch.no_grad():
        out = hydra(**x)
    assert (out.member_logits - _member_logits(members, x)).abs().max().item() <= TOL
    assert any(isinstance(m, GroupedLinear) for m in hydra.modules())


@pytest.mark.parametrize(("factory", "inputs"), [(tiny_bert, text_inputs), (tiny_vit, image_inputs)])
def test_merge_mode_equals_an_ensemble_with_averaged_mlps(factory, inputs):
    model = factory(layers=2, heads=4, head_dim=3)
    members = _perturbed_members(model, MEMBER_HEADS)
    hydra = he.fuse(members, mlp="merge").eval()
    assert hydra.policy == he.FusionPolicy(mlp="merge", norm="exact", classifier="exact", embeddings="merge")

    # explicit reference: average what the policy merges (MLP linears, embeddings), keep the rest
    adapter = he.get_adapter(model)
    reference = [copy.deepcopy(m) for m in members]
    skip = tuple(p for layer in range(2) for p in adapter.attention_paths(layer))
    merged_names = [
        name
        for name, _ in members[0].named_parameters()
        if not any(name.startswith(s + ".") for s in skip)
        and (
            name.startswith(adapter.embeddings_path + ".")
            or adapter.part_of(name.rpartition(".")[0], members[0].get_submodule(name.rpartition(".")[0]))
            == "mlp"
        )
    ]
    assert any("intermediate" in n or "fc1" in n for n in merged_names)
    with torch.no_grad():
        for name in merged_names:
            mean = torch.stack([m.get_parameter(name) for m in members]).mean(0)
            for r in reference:
                r.get_parameter(name).copy_(mean)
    x = inputs()
    with torch.no_grad():
        out = hydra(**x)
    assert (out.member_logits - _member_logits(reference, x)).abs().max().item() <= TOL
    assert (out.member_logits - _member_logits(members, x)).abs().max().item() > 1e-3


def test_merge_everything_shares_all_but_attention():
    members = _perturbed_members(tiny_bert(layers=2, heads=4, head_dim=3), MEMBER_HEADS)
    hydra = he.fuse(members, mlp="merge", norms="merge", classifier="merge")
    assert hydra.layout == ()
    assert not any(isinstance(m, GroupedLinear) for m in hydra.modules())


def test_zero_shot_members_are_identical_in_both_modes():
    model = tiny_bert(layers=2, heads=4)
    members = [he.prune(model, hs) for hs in MEMBER_HEADS]
    x = text_inputs()
    with torch.no_grad():
        merge = he.fuse(members, mlp="merge").eval()(**x).member_logits
        exact = he.fuse(members, mlp="exact").eval()(**x).member_logits
        direct = he.fuse(model, MEMBER_HEADS).eval()(**x).member_logits
    assert torch.equal(merge, exact)
    assert torch.allclose(merge, direct, atol=TOL)
    assert he.fuse(members, mlp="exact").layout == ()


def test_fusion_leaves_members_untouched():
    model = tiny_bert()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hydra = he.fuse(model, MEMBER_HEADS)
    with torch.no_grad():
        for p in hydra.parameters():
            p.zero_()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_follows_the_module(dtype):
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    hydra = he.fuse(model, MEMBER_HEADS).to(dtype).eval()
    members = [he.prune(model, hs).to(dtype) for hs in MEMBER_HEADS]
    x = text_inputs()
    with torch.no_grad():
        out = hydra(**x)
    assert out.member_logits.dtype == dtype and out.probs.dtype == torch.float32
    tol = TOL if dtype == torch.float32 else 5e-2
    assert (out.member_logits.float() - _member_logits(members, x).float()).abs().max().item() <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    hydra = he.fuse(model, MEMBER_HEADS).eval()
    x = text_inputs()
    with torch.no_grad():
        cpu = hydra(**x).member_logits
        gpu = hydra.cuda()(**{k: v.cuda() for k, v in x.items()}).member_logits.cpu()
    assert torch.allclose(cpu, gpu, atol=1e-4)


def test_headless_base_models_give_member_hidden_states():
    from transformers import BertConfig, BertModel

    model = BertModel(
        BertConfig(
            vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=9
        )
    ).eval()
    out = he.fuse(model, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})]).eval()(**text_inputs(batch=3))
    assert out.member_logits is None and out.probs is None
    assert out.members["last_hidden_state"].shape == (2, 3, 9, 8)


def test_one_sdpa_call_per_layer_and_no_loop_over_heads(monkeypatch):
    model = tiny_bert(layers=3, heads=4)
    hydra = he.fuse(model, MEMBER_HEADS).eval()
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        hydra(**text_inputs(batch=4))
    # one call per layer that keeps any head; batched over all members' rows
    assert len(calls) == 3 and all(shape[0] == 3 * 4 for shape in calls)
    assert sum(isinstance(m, FusedMultiHeadAttention) for m in hydra.modules()) == 3


@settings(max_examples=30, deadline=None)
@given(
    ensembles("bert"),
    st.integers(1, 7),
    st.integers(2, 9),
    st.sampled_from([1, 8, 20, 57, None]),
    st.booleans(),
    st.integers(0, 99),
)
def test_chunked_inference_equals_the_members(case, batch, tokens, chunk_rows, trunk, seed):
    """Inference in row chunks (any size, down to one input per chunk) gives the members' logits."""
    model, head_sets = case
    inputs = text_inputs(batch=batch, tokens=tokens, seed=seed, padded=True)
    hydra = he.fuse(model, head_sets, shared_trunk=trunk).eval()
    hydra.chunk_rows = chunk_rows
    with torch.no_grad():
        out = hydra(**inputs, labels=torch.zeros(batch, dtype=torch.long))
        whole = hydra(**inputs).member_logits if chunk_rows is None else None
    expected = _member_logits([he.prune(model, hs) for hs in head_sets], inputs)
    assert out.member_logits.shape == expected.shape
    assert (out.member_logits - expected).abs().max().item() <= TOL
    assert torch.isfinite(out.loss)
    if whole is not None:
        assert torch.equal(whole, out.member_logits)


def test_chunks_are_balanced_and_sized_by_rows():
    hydra = he.fuse(tiny_bert(layers=2, heads=4), MEMBER_HEADS).eval()  # M = 3
    x = text_inputs(batch=8, tokens=5)
    hydra.chunk_rows = 3 * 5 * 5  # room for 5 inputs: 8 -> two chunks of 4
    with torch.no_grad():
        assert hydra.inputs_per_chunk(x, 8) == 4
    hydra.chunk_rows = 1
    with torch.no_grad():
        assert hydra.inputs_per_chunk(x, 8) == 1
    hydra.chunk_rows = None
    with torch.no_grad():
        assert hydra.inputs_per_chunk(x, 8) == 8
    hydra.chunk_rows = 1
    assert hydra.inputs_per_chunk(x, 8) == 8  # autograd on: never chunked (training as before)


def test_chunked_vit_inference_equals_the_members():
    model = tiny_vit(layers=2, heads=4, head_dim=3)
    hydra = he.fuse(model, MEMBER_HEADS).eval()
    hydra.chunk_rows = 1
    x = image_inputs(batch=5)
    assert hydra.adapter.tokens_per_input(hydra.model, x) == 5  # 2 x 2 patches + [CLS]
    with torch.no_grad():
        out = hydra(**x)
    expected = _member_logits([he.prune(model, hs) for hs in MEMBER_HEADS], x)
    assert (out.member_logits - expected).abs().max().item() <= TOL


def test_the_task_heads_part_is_called_classifier_and_its_old_name_still_answers():
    """``head`` was the part's name in fuse(), FineTuneConfig and saved policies: it still works,
    with a DeprecationWarning, and means the same part."""
    from hydra_ensembles.fusion.model import FusionPolicy
    from hydra_ensembles.training import FineTuneConfig

    assert FusionPolicy.from_dict(
        {"mlp": "merge", "norm": "exact", "head": "merge", "embeddings": "merge"}
    ) == (FusionPolicy(classifier="merge"))
    with pytest.warns(DeprecationWarning, match="classifier"):
        assert FineTuneConfig(trainable=("mlp", "head")).trainable == ("mlp", "classifier")
