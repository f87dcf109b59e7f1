"""DeBERTa's disentangled attention for M pruned members in one pass.

Each head's score adds to content-to-content (q . k) a content-to-position term (its query
against the relative positions' keys, c2p) and a position-to-content term (its key against the
relative positions' queries, p2c). The positions' keys and queries are the shared relative
position table (the encoder's ``rel_embeddings``, layer-normed) through the layer's own W_K and
W_Q (DeBERTa-v3's ``share_att_key``) or through separate position projections: pruning a head
keeps exactly its rows of all of them, so each member's kept heads carry their own position
terms. The fused module computes every member's heads, their c2p and p2c terms included, in one
batched computation (`FusedMultiHeadAttention`'s storage: Q/K/V and W_O per member, padded to the
largest member, exact as there); members whose position tables differ (fine-tuned) pass them as
(M, positions, hidden), one per member (`MemberTable`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..errors import InputError
from .attention import FusedMultiHeadAttention
from .grouped import StackedTables, grouped_matmul


class MemberTable(StackedTables):
    """M copies of a table every layer reads whole through ``.weight`` (DeBERTa's relative
    position embeddings), stacked (M, rows, width): member m's copy is ``weight[m]``."""

    layout_kind: ClassVar[str] = "member_table"

    def extra_repr(self) -> str:
        return (
            f"num_members={self.weight.shape[0]}, rows={self.weight.shape[1]}, width={self.weight.shape[2]}"
        )


class FusedDisentangledAttention(FusedMultiHeadAttention):
    """`FusedMultiHeadAttention` with DeBERTa's relative position terms; called as Hugging Face's
    ``DisentangledSelfAttention`` is (``relative_pos``, ``rel_embeddings``) and returns its
    context after W_O (the fused module applies W_O and its bias).

    ``position``: the attention's settings (``pos_att_type``, ``share_att_key``, ``span`` = the
    position embedding size, ``dropout`` on the position table). Without ``share_att_key`` the
    members' position projections are ``pos_key`` / ``pos_query`` (M, H_max * d, D), padded."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        heads_per_member: Sequence[int],
        dropout: float = 0.0,
        device=None,
        dtype=None,
        heads: Sequence[Sequence[int]] | None = None,
        bias_stride: int = 0,
        *,
        pos_att_type: Sequence[str] = ("p2c", "c2p"),
        share_att_key: bool = True,
        span: int = 256,
        position_dropout: float = 0.0,
    ) -> None:
        super().__init__(hidden_size, head_dim, heads_per_member, dropout, device, dtype, heads, bias_stride)
        self.pos_att_type = tuple(pos_att_type)
        self.share_att_key, self.span = bool(share_att_key), int(span)
        self.pos_dropout = nn.Dropout(position_dropout)
        width, m = self.max_heads * head_dim, self.num_members
        factory = {"device": device, "dtype": dtype}
        for name, kind in (("pos_key", "c2p"), ("pos_query", "p2c")):
            if not share_att_key and kind in self.pos_att_type:
                self.register_parameter(
                    f"{name}_weight", nn.Parameter(torch.zeros(m, width, hidden_size, **factory))
                )
                self.register_parameter(f"{name}_bias", nn.Parameter(torch.zeros(m, width, **factory)))

    def set_position_projections(self, name: str, linears: Sequence[nn.Linear]) -> None:
        """Copy the members' (pruned) position projections ``name`` ("pos_key" / "pos_query")."""
        weight, bias = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
        with torch.no_grad():
            for m, linear in enumerate(linears):
                rows = linear.weight.shape[0]
                weight[m, :rows] = linear.weight
                if linear.bias is not None:
                    bias[m, :rows] = linear.bias

    def num_effective_parameters(self) -> int:
        kept = sum(self.heads_per_member) * self.head_dim
        extra = sum(getattr(self, f"{n}_weight", None) is not None for n in ("pos_key", "pos_query"))
        return super().num_effective_parameters() + extra * kept * (self.hidden_size + 1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        query_states: torch.Tensor | None = None,
        relative_pos: torch.Tensor | None = None,
        rel_embeddings: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if query_states is not None:
            raise InputError("fused disentangled attention takes no separate query_states")
        rows, tokens, hidden = hidden_states.shape
        m, h, dh = self.num_members, self.max_heads, self.head_dim
        if rows % m:
            raise InputError(f"a member-stacked batch needs a multiple of {m} rows, got {rows}")
        if h == 0:
            bias = self.o_bias.to(hidden_states.dtype).view(m, 1, hidden)
            return bias.expand(m, rows // m * tokens, hidden).reshape(rows, tokens, hidden), None
        qkv = grouped_matmul(hidden_states.reshape(m, -1, hidden), self.qkv_weight, self.qkv_bias)
        q, k, v = (t.transpose(1, 2) for t in qkv.view(rows, tokens, 3, h, dh).unbind(2))  # (rows, h, T, d)
        factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        scale = torch.sqrt(torch.tensor(dh, dtype=torch.float) * factor)
        scores = q @ (k.transpose(-1, -2) / scale.to(dtype=q.dtype))
        if rel_embeddings is not None and self.pos_att_type:
            scores = scores + self._position_terms(q, k, relative_pos, rel_embeddings, scale)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.bool(), torch.finfo(q.dtype).min)
        probs = nn.functional.softmax(scores, dim=-1)
        probs = nn.functional.dropout(probs, self.dropout, self.training)
        context = (probs @ v).transpose(1, 2).reshape(m, -1, h * dh)
        return grouped_matmul(context, self.o_weight, self.o_bias).view(rows, tokens, hidden), None

    def _position_terms(self, q, k, relative_pos, rel_embeddings, scale) -> torch.Tensor:
        """The c2p and p2c terms of every member's heads, (rows, h, T, T)."""
        m, h, dh, width = self.num_members, self.max_heads, self.head_dim, self.max_heads * self.head_dim
        rows, tokens = q.shape[0], q.shape[2]
        table = self.pos_dropout(rel_embeddings)
        table = (table if table.dim() == 3 else table[None])[:, : 2 * self.span]
        if table.shape[0] not in (1, m):
            raise InputError(f"{table.shape[0]} relative position tables for {m} members")
        table = table.expand(m, -1, -1)
        index = _relative_index(relative_pos, q.device)  # (1 or rows, 1, T, T)
        index = index.unflatten(0, (m, -1)) if index.shape[0] == rows else index[None]
        q5, k5 = q.unflatten(0, (m, -1)), k.unflatten(0, (m, -1))  # (M, B, h, T, d)
        score = 0
        for kind, states in (("c2p", q5), ("p2c", k5)):
            if kind not in self.pos_att_type:
                continue
            if self.share_att_key:  # the layer's own W_K (c2p) or W_Q (p2c) rows
                start = width if kind == "c2p" else 0
                weight = self.qkv_weight[:, start : start + width]
                bias = self.qkv_bias[:, start : start + width]
            else:
                name = "pos_key" if kind == "c2p" else "pos_query"
                weight, bias = getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias")
            positions = grouped_matmul(table, weight, bias).view(m, -1, h, dh).transpose(1, 2)  # (M, h, P, d)
            attention = states @ positions[:, None].transpose(-1, -2)  # (M, B, h, T, P)
            where = index if kind == "c2p" else -index
            where = torch.clamp(where + self.span, 0, 2 * self.span - 1).expand(*attention.shape[:-1], tokens)
            term = torch.gather(attention, -1, where)
            if kind == "p2c":
                term = term.transpose(-1, -2)
            score = score + term / scale.to(dtype=term.dtype)
        return score.flatten(0, 1)

    def extra_repr(self) -> str:
        position = f"pos_att_type={list(self.pos_att_type)}, share_att_key={self.share_att_key}"
        return f"{super().extra_repr()}, {position}"


def _relative_index(relative_pos: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """DeBERTa's relative positions (query - key, log-bucketed as the encoder made them) as
    (batch or 1, 1, T, T)."""
    if relative_pos is None:
        raise InputError("disentangled attention needs the encoder's relative_pos")
    if relative_pos.dim() == 2:
        relative_pos = relative_pos[None, None]
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos[:, None]
    elif relative_pos.dim() != 4:
        raise InputError(f"relative positions must have 2, 3 or 4 dimensions, got {relative_pos.dim()}")
    return relative_pos.to(device=device, dtype=torch.long)
