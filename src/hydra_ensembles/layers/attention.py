"""Fused multi-head attention over a member-stacked batch (the paper's eqs. 4-7).

Member m keeps ``heads[m]`` heads (any count, ragged across members). Its Q/K/V rows and W_O
columns are stored padded to the largest member, so that

* Q, K and V of all members come from ONE grouped matmul (`grouped_matmul`: one ``baddbmm`` on
  a GPU, one ``addmm`` per member on a CPU, whichever the device runs faster),
* all heads of all members go through ONE ``scaled_dot_product_attention`` call, batched as
  (M*B, H_max, T, d_head), so every head attends only within its own member's rows,
* the output projection is ONE grouped matmul, with each member's own W_O bias.

Padded heads have zero Q/K/V weights and biases, so their attention output is exactly zero and
meets zero W_O columns: the result is exact. When all members keep the same number of heads
(the usual case) there is no padding at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .grouped import grouped_matmul


class FusedMultiHeadAttention(nn.Module):
    """Attention of M pruned members in one pass; returns ``(output, None)`` like HF modules."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        heads_per_member: Sequence[int],
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if not heads_per_member:
            raise ValueError("FusedMultiHeadAttention needs at least one member")
        self.hidden_size, self.head_dim, self.dropout = hidden_size, head_dim, dropout
        self.heads_per_member = tuple(int(h) for h in heads_per_member)
        self.num_members = len(self.heads_per_member)
        self.max_heads = max(self.heads_per_member)
        width = self.max_heads * head_dim
        factory = {"device": device, "dtype": dtype}
        m = self.num_members
        self.qkv_weight = nn.Parameter(torch.zeros(m, 3 * width, hidden_size, **factory))
        self.qkv_bias = nn.Parameter(torch.zeros(m, 3 * width, **factory))
        self.o_weight = nn.Parameter(torch.zeros(m, hidden_size, width, **factory))
        self.o_bias = nn.Parameter(torch.zeros(m, hidden_size, **factory))

    @classmethod
    def from_projections(
        cls,
        projections: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]],
        head_dim: int,
        dropout: float = 0.0,
    ) -> FusedMultiHeadAttention:
        """From each member's pruned (query, key, value, output) linears."""
        if any(type(lin) is not nn.Linear for group in projections for lin in group):
            raise TypeError("fusion needs plain nn.Linear projections (not e.g. BatchEnsemble layers)")
        heads = [q.out_features // head_dim for q, _, _, _ in projections]
        ref = projections[0][3].weight
        fused = cls(ref.shape[0], head_dim, heads, dropout, device=ref.device, dtype=ref.dtype)
        width = fused.max_heads * head_dim
        with torch.no_grad():
            for m, (q, k, v, o) in enumerate(projections):
                rows = q.out_features
                for i, lin in enumerate((q, k, v)):
                    fused.qkv_weight[m, i * width : i * width + rows] = lin.weight
                    if lin.bias is not None:
                        fused.qkv_bias[m, i * width : i * width + rows] = lin.bias
                fused.o_weight[m, :, :rows] = o.weight
                if o.bias is not None:
                    fused.o_bias[m] = o.bias
        return fused

    def num_effective_parameters(self) -> int:
        """Parameters without the zero padding of ragged members."""
        kept = sum(self.heads_per_member) * self.head_dim
        return 4 * kept * self.hidden_size + 3 * kept + self.num_members * self.hidden_size

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs
    ) -> tuple[torch.Tensor, None]:
        rows, tokens, hidden = hidden_states.shape
        m, h, dh = self.num_members, self.max_heads, self.head_dim
        if rows % m:
            raise ValueError(f"a member-stacked batch needs a multiple of {m} rows, got {rows}")
        if h == 0:  # no member keeps a head here: attention adds only each member's W_O bias
            bias = self.o_bias.to(hidden_states.dtype).view(m, 1, hidden)
            return bias.expand(m, rows // m * tokens, hidden).reshape(rows, tokens, hidden), None
        qkv = grouped_matmul(hidden_states.reshape(m, -1, hidden), self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(rows, tokens, 3, h, dh).unbind(2)
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=dh**-0.5,
        )
        z = z.transpose(1, 2).reshape(m, -1, h * dh)
        out = grouped_matmul(z, self.o_weight, self.o_bias)
        return out.view(rows, tokens, hidden), None

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, "
            f"heads_per_member={list(self.heads_per_member)}"
        )
