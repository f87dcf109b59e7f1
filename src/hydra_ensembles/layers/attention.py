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

Families that add a per-head bias to the attention scores (MPNet's relative position bias,
``position_bias`` (rows, H, T, T) over the original heads) get each member's kept heads' channels:
``heads`` records which original heads each member keeps; where members have their own bias
tables (`MemberHeadBias`, channels ``m * H + h``), ``bias_stride`` is H.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError, UnsupportedModelError
from .grouped import grouped_matmul

_MEMBER_ATTENTION_OPS = contextvars.ContextVar("member_attention_ops", default=False)
_OPEN_EXPORTS = 0
"""How many `member_attention_ops` contexts are open, in any thread: what traced code reads, as
dynamo cannot trace a context variable (a graph break in every layer, which also keeps CUDA
graphs from capturing the pass) but reads a module global and guards on its value."""
_OPEN_EXPORTS_LOCK = threading.Lock()


@contextlib.contextmanager
def member_attention_ops() -> Iterator[None]:
    """While tracing for export, fused attention is written as one `member_attention` operator per
    member (which an exporter can map to a runtime's own attention kernel) wherever that computes
    the same: no per-head score bias and a boolean mask (or none) shared by the heads."""
    global _OPEN_EXPORTS
    token = _MEMBER_ATTENTION_OPS.set(True)
    with _OPEN_EXPORTS_LOCK:
        _OPEN_EXPORTS += 1
    try:
        yield
    finally:
        with _OPEN_EXPORTS_LOCK:
            _OPEN_EXPORTS -= 1
        _MEMBER_ATTENTION_OPS.reset(token)


def _per_member_export() -> bool:
    """Whether `member_attention_ops` is on. Eager code reads this thread's context variable;
    traced code (``torch.compile``, ``torch.export``) reads whether any export is open, since
    ``torch.compiler.is_exporting()`` does not tell the two apart in every torch version (it is
    true under ``torch.compile`` too in torch 2.11). A model compiled in one thread while another
    exports computes the same, with the per-member operator."""
    if torch.compiler.is_compiling():
        return _OPEN_EXPORTS > 0
    return _MEMBER_ATTENTION_OPS.get()


@torch.library.custom_op("hydra_ensembles::member_attention", mutates_args=())
def member_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """One member's attention before its output projection, in the layout of onnxruntime's
    ``Attention`` operator: ``x`` (B, T, D); ``weight`` (D, 3 * H * d), the columns of Q, K then
    V, head after head; ``bias`` (3 * H * d); ``mask`` (B, T, T) int32, 1 where a query may read a
    key (None: everywhere). Returns (B, T, H * d)."""
    b, t, _ = x.shape
    qkv = torch.addmm(bias, x.reshape(b * t, -1), weight).view(b, t, 3, num_heads, -1)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    allowed = None if mask is None else mask.unsqueeze(1).bool()
    z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return z.transpose(1, 2).reshape(b, t, -1)


@member_attention.register_fake
def _(x, weight, bias, mask, num_heads, scale):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[1] // 3)


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
        heads: Sequence[Sequence[int]] | None = None,
        bias_stride: int = 0,
    ) -> None:
        super().__init__()
        if not heads_per_member:
            raise InputError("FusedMultiHeadAttention needs at least one member")
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
        if heads is None:  # a bare module: member m keeps original heads 0 .. h_m - 1
            heads = [range(h) for h in self.heads_per_member]
        if [len(h) for h in heads] != list(self.heads_per_member):
            raise InputError(f"heads {heads} do not match heads_per_member {list(self.heads_per_member)}")
        index = torch.zeros(m, self.max_heads, dtype=torch.long, device=device)
        for member, kept in enumerate(heads):
            index[member, : len(kept)] = torch.tensor(list(kept), dtype=torch.long) + member * bias_stride
        self.register_buffer("head_index", index, persistent=False)
        """(M, H_max) the score-bias channel of each member's head slot (padded slots: any channel,
        their output is 0)."""

    @classmethod
    def from_projections(
        cls,
        projections: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]],
        head_dim: int,
        dropout: float = 0.0,
        heads: Sequence[Sequence[int]] | None = None,
        bias_stride: int = 0,
        **settings,
    ) -> FusedMultiHeadAttention:
        """From each member's pruned (query, key, value, output) linears; ``heads``: the original
        heads each member keeps, ``bias_stride`` (see the module docstring): for families with a
        per-head score bias; ``settings``: a subclass's own."""
        if any(type(lin) is not nn.Linear for group in projections for lin in group):
            raise UnsupportedModelError(
                "fusion needs plain nn.Linear projections (not e.g. BatchEnsemble layers)"
            )
        ref = projections[0][3].weight
        counts = [q.out_features // head_dim for q, _, _, _ in projections]
        fused = cls(
            ref.shape[0],
            head_dim,
            counts,
            dropout,
            device=ref.device,
            dtype=ref.dtype,
            heads=heads,
            bias_stride=bias_stride,
            **settings,
        )
        fused.load_projections(projections)
        return fused

    def load_projections(
        self, projections: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]]
    ) -> None:
        """Copy each member's (query, key, value, output) linears into the padded storage."""
        fused, width = self, self.max_heads * self.head_dim
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

    def num_effective_parameters(self) -> int:
        """Parameters without the zero padding of ragged members."""
        kept = sum(self.heads_per_member) * self.head_dim
        return 4 * kept * self.hidden_size + 3 * kept + self.num_members * self.hidden_size

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        rows, tokens, hidden = hidden_states.shape
        m, h, dh = self.num_members, self.max_heads, self.head_dim
        if rows % m:
            raise InputError(f"a member-stacked batch needs a multiple of {m} rows, got {rows}")
        if h == 0:  # no member keeps a head here: attention adds only each member's W_O bias
            bias = self.o_bias.to(hidden_states.dtype).view(m, 1, hidden)
            return bias.expand(m, rows // m * tokens, hidden).reshape(rows, tokens, hidden), None
        if _per_member_export() and position_bias is None:
            per_member = self._per_member_ops(hidden_states, attention_mask)
            if per_member is not None:
                return per_member, None
        qkv = grouped_matmul(hidden_states.reshape(m, -1, hidden), self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(rows, tokens, 3, h, dh).unbind(2)
        if position_bias is not None:
            bias = self._member_bias(position_bias, rows)
            attention_mask = bias if attention_mask is None else bias + attention_mask
        boolean = attention_mask is not None and attention_mask.dtype == torch.bool
        if boolean and torch.compiler.is_exporting():
            # the ONNX exporter lowers a boolean mask to a Where over every score (B*M x H x T x T,
            # materialised); an additive mask of the same meaning is one broadcast Add
            additive = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            attention_mask = additive.masked_fill(~attention_mask, float("-inf"))
        z = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attention_mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=dh**-0.5,
        )
        z = z.transpose(1, 2)
        if torch.compiler.is_exporting():
            # torch.export sees attention's output laid out as (rows, T, H, d) and writes the
            # reshape as a view, which the ONNX exporter's own attention layout refuses: copy
            z = z.clone(memory_format=torch.contiguous_format)
        z = z.reshape(m, -1, h * dh)
        out = grouped_matmul(z, self.o_weight, self.o_bias)
        return out.view(rows, tokens, hidden), None

    def _per_member_ops(self, hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The forward as one `member_attention` operator and one output projection per member;
        None where the mask is not a boolean (rows or 1, 1, T, T) one."""
        rows, tokens, _ = hidden_states.shape
        m = self.num_members
        if mask is not None:
            shared = mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[0] in (1, rows)
            if mask.dtype != torch.bool or not shared:
                return None
            mask = mask.expand(rows, 1, tokens, tokens)[:, 0].to(torch.int32).unflatten(0, (m, -1))
        members = hidden_states.unflatten(0, (m, -1))
        out = []
        for member in range(m):
            z = member_attention(
                members[member],
                self.qkv_weight[member].t(),
                self.qkv_bias[member],
                None if mask is None else mask[member],
                self.max_heads,
                self.head_dim**-0.5,
            )
            out.append(F.linear(z, self.o_weight[member], self.o_bias[member]))
        return torch.cat(out)

    def _member_bias(self, position_bias: torch.Tensor, rows: int) -> torch.Tensor:
        """(rows, H_max, T, T): each member's rows get its kept heads' channels of the bias."""
        m = self.num_members
        if position_bias.shape[0] not in (1, rows):
            raise InputError(f"position_bias has {position_bias.shape[0]} rows for {rows} hidden-state rows")
        bias = position_bias.expand(rows, *position_bias.shape[1:]).unflatten(0, (m, rows // m))
        index = self.head_index.to(bias.device)[:, None, :, None, None].expand(
            -1, rows // m, -1, *bias.shape[-2:]
        )
        return bias.gather(2, index).flatten(0, 1)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, "
            f"heads_per_member={list(self.heads_per_member)}"
        )
