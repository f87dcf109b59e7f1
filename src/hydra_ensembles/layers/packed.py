"""Packed layers (Laurent et al., 2023): M members side by side in the channels of one model.

Where a member-stacked batch puts members in the rows (`grouped`), a packed model puts them in
the channels: a hidden state of width W holds M member blocks of W/M channels, member m in
channels ``m*W/M .. (m+1)*W/M - 1``. `PackedLinear` is a block-diagonal linear layer with G
groups (G = M*gamma inside a member's layers, G = M for its task head) and `PackedLayerNorm`
normalises each member's block on its own, so that no member ever reads another's channels.
torch-uncertainty's ``PackedLinear``/``PackedLayerNorm`` are the reference design (they cannot be
imported on this CPU build of torch); these store only the diagonal blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .grouped import grouped_matmul


class PackedLinear(nn.Module):
    """A linear layer with ``groups`` independent diagonal blocks: ``(..., in) -> (..., out)``.

    Block g maps input channels ``g*in/G .. (g+1)*in/G - 1`` to output channels
    ``g*out/G .. (g+1)*out/G - 1``. With ``chunks`` > 1 the input is ``chunks`` packed vectors
    concatenated (e.g. DINOv2's head reads [CLS, mean patch token]): block g reads its channels
    of every chunk.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        groups: int,
        bias: bool = True,
        chunks: int = 1,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if groups < 1 or chunks < 1:
            raise InputError(f"groups and chunks must be positive, got {groups} and {chunks}")
        if in_features % (groups * chunks) or out_features % groups:
            raise InputError(
                f"PackedLinear({in_features}, {out_features}) cannot be split into {groups} groups"
                + (f" of {chunks} chunks" if chunks > 1 else "")
            )
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.groups, self.chunks = groups, chunks
        self.weight = nn.Parameter(
            torch.empty(groups, out_features // groups, in_features // groups, **factory)
        )
        self.bias = nn.Parameter(torch.zeros(groups, out_features // groups, **factory)) if bias else None
        for g in range(groups):
            nn.init.kaiming_uniform_(self.weight[g], a=5**0.5)  # nn.Linear's default, per block

    @classmethod
    def from_linear(cls, linear: nn.Linear, groups: int, chunks: int = 1) -> PackedLinear:
        """The diagonal blocks of ``linear`` (its weights off the blocks are dropped)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            groups,
            bias=linear.bias is not None,
            chunks=chunks,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(layer.blocks_of(linear.weight))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.reshape(groups, -1))
        return layer

    def blocks_of(self, weight: torch.Tensor) -> torch.Tensor:
        """The (G, out/G, in/G) diagonal blocks of a dense (out, in) weight, in this layer's layout."""
        g, c = self.groups, self.chunks
        per_out, per_in = self.out_features // g, self.in_features // (g * c)
        blocks = weight.reshape(g, per_out, c, g, per_in)
        return torch.stack([blocks[i, :, :, i, :] for i in range(g)]).reshape(g, per_out, c * per_in)

    def dense_weight(self) -> torch.Tensor:
        """The equivalent dense (out, in) weight, zeros off the blocks (for tests and export)."""
        g, c = self.groups, self.chunks
        per_out, per_in = self.out_features // g, self.in_features // (g * c)
        dense = self.weight.new_zeros(g, per_out, c, g, per_in)
        blocks = self.weight.reshape(g, per_out, c, per_in)
        for i in range(g):
            dense[i, :, :, i, :] = blocks[i]
        return dense.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, c = self.groups, self.chunks
        lead = x.shape[:-1]
        grouped = (
            x.reshape(-1, c, g, self.in_features // (g * c))
            .permute(2, 0, 1, 3)
            .reshape(g, -1, self.in_features // g)
        )
        out = grouped_matmul(grouped, self.weight, self.bias)  # (G, N, out/G)
        return out.transpose(0, 1).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}"
            + (f", chunks={self.chunks}" if self.chunks > 1 else "")
            + f", bias={self.bias is not None}"
        )


class PackedLayerNorm(nn.Module):
    """LayerNorm of each of ``groups`` channel blocks on its own, with a per-channel affine."""

    def __init__(
        self, num_channels: int, groups: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None
    ):
        super().__init__()
        if num_channels % groups:
            raise InputError(f"{num_channels} channels cannot be split into {groups} groups")
        factory = {"device": device, "dtype": dtype}
        self.num_channels, self.groups, self.eps = num_channels, groups, eps
        self.weight = nn.Parameter(torch.ones(num_channels, **factory))
        self.bias = nn.Parameter(torch.zeros(num_channels, **factory)) if bias else None

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, groups: int) -> PackedLayerNorm:
        if len(norm.normalized_shape) != 1 or not norm.elementwise_affine:
            raise InputError("PackedLayerNorm replaces affine LayerNorms over one dimension")
        layer = cls(norm.normalized_shape[0], groups, norm.eps, norm.bias is not None,
                    norm.weight.device, norm.weight.dtype)  # fmt: skip
        with torch.no_grad():
            layer.weight.copy_(norm.weight)
            if norm.bias is not None:
                layer.bias.copy_(norm.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.num_channels // self.groups
        normed = F.layer_norm(x.reshape(*x.shape[:-1], self.groups, width), (width,), eps=self.eps)
        normed = normed.reshape(x.shape)
        return normed * self.weight if self.bias is None else torch.addcmul(self.bias, normed, self.weight)

    def extra_repr(self) -> str:
        return f"num_channels={self.num_channels}, groups={self.groups}, eps={self.eps}"
