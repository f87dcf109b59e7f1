"""Grouped layers apply member m's weights to member m's rows, exactly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_ensembles.layers import (
    FusedMultiHeadAttention,
    GroupedLayerNorm,
    GroupedLinear,
    MemberHeadBias,
    PerMemberModule,
)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 9), st.integers(1, 9), st.booleans())
def test_grouped_linear_matches_each_member(members, batch, fan_in, fan_out, bias):
    linears = [torch.nn.Linear(fan_in, fan_out, bias=bias) for _ in range(members)]
    grouped = GroupedLinear.from_linears(linears)
    x = torch.randn(members * batch, 3, fan_in)
    expected = torch.cat([lin(x[m * batch : (m + 1) * batch]) for m, lin in enumerate(linears)])
    assert torch.allclose(grouped(x), expected, atol=1e-6)


def test_grouped_layer_norm_matches_each_member():
    norms = [torch.nn.LayerNorm(7, eps=1e-6) for _ in range(3)]
    for norm in norms:
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    grouped = GroupedLayerNorm.from_layer_norms(norms)
    x = torch.randn(6, 4, 7)
    expected = torch.cat([n(x[2 * m : 2 * m + 2]) for m, n in enumerate(norms)])
    assert torch.allclose(grouped(x), expected, atol=1e-5)


def test_per_member_module_splits_tensor_arguments():
    modules = [torch.nn.Embedding(10, 4) for _ in range(2)]
    wrapped = PerMemberModule(modules)
    ids = torch.randint(0, 10, (4, 3))
    expected = torch.cat([modules[0](ids[:2]), modules[1](ids[2:])])
    assert torch.equal(wrapped(ids), expected)
    assert wrapped.num_embeddings == 10  # attributes come from member 0


def test_rows_must_be_a_multiple_of_members():
    grouped = GroupedLinear.from_linears([torch.nn.Linear(2, 2) for _ in range(3)])
    with pytest.raises(ValueError, match="multiple of 3 rows"):
        grouped(torch.randn(4, 2))
    attention = FusedMultiHeadAttention(4, 2, [1, 2])
    with pytest.raises(ValueError, match="multiple of 2 rows"):
        attention(torch.randn(3, 5, 4))


def test_fused_attention_with_no_heads_returns_each_members_bias():
    attention = FusedMultiHeadAttention(4, 2, [0, 0])
    with torch.no_grad():
        attention.o_bias.copy_(torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]))
    out, _ = attention(torch.randn(6, 5, 4))
    assert torch.equal(out[:3], attention.o_bias[0].expand(3, 5, 4))
    assert torch.equal(out[3:], attention.o_bias[1].expand(3, 5, 4))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_fused_attention_matches_explicit_multi_head_attention():
    torch.manual_seed(0)
    d, dh = 6, 3
    members = []
    for heads in (2, 1, 0):
        qkv = [torch.nn.Linear(d, heads * dh) for _ in range(3)]
        members.append((*qkv, torch.nn.Linear(heads * dh, d)))
    fused = FusedMultiHeadAttention.from_projections(members, dh)
    x = torch.randn(3 * 2, 5, d)
    out, _ = fused(x)
    for m, (q, k, v, o) in enumerate(members):
        rows = x[2 * m : 2 * m + 2]
        h = q.out_features // dh
        if h == 0:
            expected = o.bias.expand(2, 5, d)
        else:
            qh, kh, vh = (lin(rows).view(2, 5, h, dh).transpose(1, 2) for lin in (q, k, v))
            att = torch.softmax(qh @ kh.transpose(-1, -2) / dh**0.5, -1)
            expected = o((att @ vh).transpose(1, 2).reshape(2, 5, h * dh))
        assert torch.allclose(out[2 * m : 2 * m + 2], expected, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_matmul_forms_agree_with_and_without_autograd(bias):
    from hydra_ensembles.layers.grouped import grouped_matmul

    x, w = torch.randn(3, 7, 5), torch.randn(3, 4, 5, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True) if bias else None
    expected = torch.bmm(x, w.transpose(1, 2)) + (b.unsqueeze(1) if bias else 0)
    with torch.no_grad():
        inference = grouped_matmul(x, w, b)  # written into one buffer
    training = grouped_matmul(x, w, b)  # stacked, differentiable
    assert torch.allclose(inference, expected, atol=1e-6) and torch.allclose(training, expected, atol=1e-6)
    training.sum().backward()
    assert torch.allclose(w.grad, x.sum(1, keepdim=True).expand(3, 4, 5), atol=1e-5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_matmul(x, w, b).dtype == torch.bfloat16  # autocast is honoured


@pytest.mark.parametrize("own_tables", [False, True])
@pytest.mark.parametrize("heads", [((1, 3), (0,), (2, 0, 3)), ((3,), (3,), (3,))])
def test_fused_attention_adds_each_members_kept_heads_score_bias(heads, own_tables):
    """A per-head score bias (MPNet's relative position bias) over the original H heads: member
    m's slot j adds channel heads[m][j] of the shared table, or of member m's own table."""
    torch.manual_seed(1)
    d, dh, big_h, batch, tokens, m = 8, 2, 4, 2, 5, len(heads)
    members = []
    for kept in heads:
        qkv = [torch.nn.Linear(d, len(kept) * dh) for _ in range(3)]
        members.append((*qkv, torch.nn.Linear(len(kept) * dh, d)))
    tables = [torch.nn.Embedding(7, big_h) for _ in range(m if own_tables else 1)]
    buckets = torch.randint(0, 7, (tokens, tokens))
    if own_tables:  # (T, T, M * H) -> (rows, M * H, T, T), as MPNet's encoder expands it
        stacked = MemberHeadBias.from_embeddings(tables)(buckets).permute(2, 0, 1)
        assert torch.equal(stacked[big_h : 2 * big_h], tables[1](buckets).permute(2, 0, 1))
    else:
        stacked = tables[0](buckets).permute(2, 0, 1)
    fused = FusedMultiHeadAttention.from_projections(
        members, dh, heads=heads, bias_stride=big_h if own_tables else 0
    )
    x = torch.randn(m * batch, tokens, d)
    mask = torch.zeros(m * batch, 1, 1, tokens)
    mask[1, ..., 3:] = -1e9
    out, _ = fused(x, mask, stacked.expand(m * batch, -1, -1, -1))
    for i, ((q, k, v, o), kept) in enumerate(zip(members, heads, strict=True)):
        rows = slice(i * batch, (i + 1) * batch)
        qh, kh, vh = (lin(x[rows]).view(batch, tokens, len(kept), dh).transpose(1, 2) for lin in (q, k, v))
        bias = tables[i if own_tables else 0](buckets).permute(2, 0, 1)[list(kept)]
        att = torch.softmax(qh @ kh.transpose(-1, -2) / dh**0.5 + bias + mask[rows], -1)
        expected = o((att @ vh).transpose(1, 2).reshape(batch, tokens, len(kept) * dh))
        assert torch.allclose(out[rows], expected, atol=1e-5)
