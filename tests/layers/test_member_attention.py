"""The fused attention written as one `member_attention` operator per member (what the ONNX export
maps to onnxruntime's Attention) computes what each member's explicit multi-head attention does."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_ensembles.layers import FusedMultiHeadAttention
from hydra_ensembles.layers.attention import member_attention_ops


def _members(hidden: int, head_dim: int, heads: list[int]) -> list[tuple[torch.nn.Linear, ...]]:
    members = []
    for h in heads:
        qkv = [torch.nn.Linear(hidden, h * head_dim) for _ in range(3)]
        members.append((*qkv, torch.nn.Linear(h * head_dim, hidden)))
    return members


def _explicit(members, head_dim, x, allowed, batch):
    """Each member's attention written out, on its own rows; ``allowed`` (B, T, T) or None."""
    out = []
    for m, (q, k, v, o) in enumerate(members):
        rows = x[m * batch : (m + 1) * batch]
        h = q.out_features // head_dim
        t = rows.shape[1]
        qh, kh, vh = (lin(rows).view(batch, t, h, head_dim).transpose(1, 2) for lin in (q, k, v))
        scores = qh @ kh.transpose(-1, -2) / head_dim**0.5
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        z = (torch.softmax(scores, -1) @ vh).transpose(1, 2).reshape(batch, t, h * head_dim)
        out.append(o(z))
    return torch.cat(out)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.integers(1, 3),
    st.integers(1, 7),
    st.sampled_from(["none", "padding", "causal"]),
    st.integers(0, 10_000),
)
def test_member_operators_equal_each_members_explicit_attention(heads, batch, tokens, mask, seed):
    torch.manual_seed(seed)
    hidden, head_dim = 8, 2
    members = _members(hidden, head_dim, heads)
    fused = FusedMultiHeadAttention.from_projections(members, head_dim).eval()
    m = len(heads)
    x = torch.randn(m * batch, tokens, hidden)
    allowed = None
    if mask == "padding":
        lengths = torch.randint(1, tokens + 1, (batch,))
        keys = torch.arange(tokens)[None, :] < lengths[:, None]
        allowed = keys[:, None, :].expand(batch, tokens, tokens)
    elif mask == "causal":
        allowed = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, tokens, tokens)
    stacked = None if allowed is None else allowed.repeat(m, 1, 1)[:, None]
    with torch.no_grad(), member_attention_ops():
        got, _ = fused(x, stacked)
        expected = _explicit(members, head_dim, x, allowed, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_member_operators_are_used_only_where_they_compute_the_same():
    torch.manual_seed(0)
    fused = FusedMultiHeadAttention.from_projections(_members(8, 2, [2, 2]), 2).eval()
    x = torch.randn(4, 3, 8)
    calls = []

    def counting(*args):
        calls.append(args)
        return torch.ops.hydra_ensembles.member_attention(*args)

    import hydra_ensembles.layers.attention as attention

    real = attention.member_attention
    attention.member_attention = counting
    try:
        with torch.no_grad(), member_attention_ops():
            fused(x, torch.ones(4, 1, 3, 3, dtype=torch.bool))  # shared boolean mask: used
            assert len(calls) == 2
            fused(x, torch.zeros(4, 1, 3, 3))  # an additive mask: the decomposed form
            fused(x, None, position_bias=torch.zeros(4, 2, 3, 3))  # a per-head score bias: same
            fused(x, torch.ones(4, 2, 3, 3, dtype=torch.bool))  # a mask per head: same
        assert len(calls) == 2
        fused(x, torch.ones(4, 1, 3, 3, dtype=torch.bool))  # outside the context: never
        assert len(calls) == 2
    finally:
        attention.member_attention = real
