"""Packed layers against explicit computation: a PackedLinear is the dense layer with zeros off
its diagonal blocks, and each block maps only its own channels."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hydra_ensembles.layers.packed import PackedLayerNorm, PackedLinear


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(1, 3),
    st.booleans(),
)
def test_packed_linear_is_block_diagonal(groups, chunks, per_in, per_out, rows, bias):
    torch.manual_seed(groups * 100 + chunks * 10 + per_in)
    dense = torch.nn.Linear(groups * chunks * per_in, groups * per_out, bias=bias)
    packed = PackedLinear.from_linear(dense, groups, chunks)
    x = torch.randn(rows, 2, dense.in_features)
    # explicit: block g reads its channels of every chunk and writes its own outputs
    pieces = x.reshape(rows, 2, chunks, groups, per_in)
    expected = []
    for g in range(groups):
        w = dense.weight[g * per_out : (g + 1) * per_out].reshape(per_out, chunks, groups, per_in)[:, :, g]
        out = torch.einsum("rtci,oci->rto", pieces[:, :, :, g], w)
        expected.append(out + (dense.bias[g * per_out : (g + 1) * per_out] if bias else 0))
    assert torch.allclose(packed(x), torch.cat(expected, -1), atol=1e-5)
    masked = packed.dense_weight()
    assert torch.allclose(torch.nn.functional.linear(x, masked, packed.bias.flatten() if bias else None),
                          packed(x), atol=1e-5)  # fmt: skip
    assert torch.equal(packed.blocks_of(masked), packed.weight.detach())


def test_packed_linear_groups_do_not_mix():
    packed = PackedLinear(6, 4, groups=2)
    x = torch.randn(3, 6)
    y = x.clone()
    y[:, 3:] += 1.0  # only group 1's inputs change
    assert torch.equal(packed(x)[:, :2], packed(y)[:, :2])
    assert not torch.allclose(packed(x)[:, 2:], packed(y)[:, 2:])


def test_packed_layer_norm_normalises_each_group_alone():
    norm = PackedLayerNorm(8, groups=2, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(5, 8)
    expected = torch.cat(
        [torch.nn.functional.layer_norm(x[:, 4 * g : 4 * g + 4], (4,), norm.weight[4 * g : 4 * g + 4],
                                        norm.bias[4 * g : 4 * g + 4], eps=1e-6) for g in range(2)], -1
    )  # fmt: skip
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="groups"):
        PackedLinear(7, 4, groups=2)
    with pytest.raises(ValueError, match="groups"):
        PackedLayerNorm(7, groups=2)
