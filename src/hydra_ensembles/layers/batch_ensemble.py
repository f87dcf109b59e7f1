"""BatchEnsemble linear layers (Wen et al., 2020) over member-stacked batches.

Member m's weight is the shared W scaled by a rank-1 factor, ``W_m = W * (s_m r_m^T)``, so
``y = ((x * r_m) @ W^T) * s_m + b_m``: one shared matrix, M pairs of vectors and M biases. Rows
``m*B .. (m+1)*B - 1`` of the input belong to member m, as in the grouped layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError


class BatchEnsembleLinear(nn.Module):
    """A linear layer shared by M members, each with its own rank-1 fast weights and bias."""

    def __init__(
        self, num_members: int, in_features: int, out_features: int, device=None, dtype=None
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_members, self.in_features, self.out_features = num_members, in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.r = nn.Parameter(torch.ones(num_members, in_features, **factory))
        self.s = nn.Parameter(torch.ones(num_members, out_features, **factory))
        self.bias = nn.Parameter(torch.zeros(num_members, out_features, **factory))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, num_members: int, init_std: float, generator: torch.Generator | None = None
    ) -> BatchEnsembleLinear:
        """Start from a trained layer: W and every member's bias copied, r and s drawn from
        N(1, init_std^2) (torch-uncertainty's ``BatchLinear`` default is 0.5)."""
        weight = linear.weight
        layer = cls(num_members, linear.in_features, linear.out_features, weight.device, weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.expand(num_members, -1))
            for factor in (layer.r, layer.s):
                noise = torch.randn(factor.shape, generator=generator, dtype=torch.float32)
                factor.copy_((1.0 + init_std * noise).to(factor.dtype))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.num_members:
            raise InputError(
                f"a member-stacked batch needs a multiple of {self.num_members} rows, got {x.shape[0]}"
            )
        rows = x.reshape(self.num_members, -1, self.in_features)
        out = torch.matmul(rows * self.r.unsqueeze(1), self.weight.t())
        out = out * self.s.unsqueeze(1) + self.bias.unsqueeze(1)
        return out.reshape(*x.shape[:-1], self.out_features)

    def member_linear(self, member: int) -> nn.Linear:
        """Member ``member``'s layer as a plain ``nn.Linear`` (W * s r^T, its bias), for checks."""
        linear = nn.Linear(
            self.in_features, self.out_features, device=self.weight.device, dtype=self.weight.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(self.weight * self.s[member, :, None] * self.r[member, None, :])
            linear.bias.copy_(self.bias[member])
        return linear

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, in_features={self.in_features}, "
            f"out_features={self.out_features}"
        )
