"""Grouped layers for member-stacked batches.

A member-stacked batch holds M members' rows one after another: rows ``m*B .. (m+1)*B - 1``
belong to member m. Grouped layers keep one set of weights per member and apply member m's
weights to member m's rows (`grouped_matmul`: no block-diagonal zeros). `PerMemberModule` is the
exact, looped fallback for modules with no grouped form.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x[m] @ weight[m].T + bias[m]`` for every member m: (M, N, in) -> (M, N, out).

    The form is chosen per device, by measurement (``docs/benchmarks.md``): on a GPU one
    ``baddbmm`` launch for all members; on a CPU one 2-D ``addmm`` per member, which the BLAS
    runs faster than ``baddbmm`` over a transposed weight. Without autograd or autocast the
    members' results are written straight into one output buffer (no concatenation copy).
    """
    if x.device.type != "cpu":
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if needs_grad or torch.is_autocast_enabled("cpu"):  # ``out=`` neither records nor casts
        return torch.stack(
            [F.linear(x[m], weight[m], None if bias is None else bias[m]) for m in range(x.shape[0])]
        )
    out = x.new_empty(x.shape[0], x.shape[1], weight.shape[1])
    for m in range(x.shape[0]):
        if bias is None:
            torch.mm(x[m], weight[m].t(), out=out[m])
        else:
            torch.addmm(bias[m], x[m], weight[m].t(), out=out[m])
    return out


def _split_members(x: torch.Tensor, num_members: int) -> torch.Tensor:
    """(M*B, ..., D) -> (M, B*..., D)."""
    if x.shape[0] % num_members:
        raise InputError(f"a member-stacked batch needs a multiple of {num_members} rows, got {x.shape[0]}")
    return x.reshape(num_members, -1, x.shape[-1])


def _fill_stacked(layer: nn.Module, sources: Sequence[nn.Module]) -> nn.Module:
    """Copy the members' ``weight`` and ``bias`` into ``layer``'s stacked parameters."""
    with torch.no_grad():
        layer.weight.copy_(torch.stack([s.weight for s in sources]))
        if layer.bias is not None:
            layer.bias.copy_(torch.stack([s.bias for s in sources]))
    return layer


class GroupedLinear(nn.Module):
    """M independent linear layers, each applied to its member's rows (`grouped_matmul`)."""

    layout_kind: ClassVar[str] = "grouped_linear"
    """How a saved Hydra model's layout names it (`fusion.model.LAYOUT_MODULES`)."""

    def __init__(
        self,
        num_members: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_members, self.in_features, self.out_features = num_members, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_members, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_members, out_features, **factory)) if bias else None

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear]) -> GroupedLinear:
        first = linears[0]
        layer = cls(
            len(linears),
            first.in_features,
            first.out_features,
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        return _fill_stacked(layer, linears)

    @classmethod
    def empty_like(cls, module: nn.Linear, num_members: int) -> GroupedLinear:
        """M layers shaped like ``module``, weights unset (a saved model fills them)."""
        return cls(num_members, module.in_features, module.out_features, module.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = grouped_matmul(_split_members(x, self.num_members), self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


class GroupedLayerNorm(nn.Module):
    """M LayerNorms over the last dimension: shared normalisation, per-member affine."""

    layout_kind: ClassVar[str] = "grouped_layer_norm"

    def __init__(
        self,
        num_members: int,
        normalized_shape: int,
        eps: float = 1e-5,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_members, self.normalized_shape, self.eps = num_members, normalized_shape, eps
        self.weight = nn.Parameter(torch.ones(num_members, normalized_shape, **factory))
        self.bias = nn.Parameter(torch.zeros(num_members, normalized_shape, **factory)) if bias else None

    @classmethod
    def from_layer_norms(cls, norms: Sequence[nn.LayerNorm]) -> GroupedLayerNorm:
        first = norms[0]
        if len(first.normalized_shape) != 1 or not first.elementwise_affine:
            raise InputError("GroupedLayerNorm supports affine LayerNorms over one dimension")
        layer = cls(
            len(norms),
            first.normalized_shape[0],
            first.eps,
            bias=first.bias is not None,
            device=first.weight.device,
            dtype=first.weight.dtype,
        )
        return _fill_stacked(layer, norms)

    @classmethod
    def empty_like(cls, module: nn.LayerNorm, num_members: int) -> GroupedLayerNorm:
        return cls(num_members, module.normalized_shape[0], module.eps, bias=module.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = _split_members(F.layer_norm(x, (self.normalized_shape,), eps=self.eps), self.num_members)
        if self.bias is None:
            return (normed * self.weight.unsqueeze(1)).reshape(x.shape)
        return torch.addcmul(self.bias.unsqueeze(1), normed, self.weight.unsqueeze(1)).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, normalized_shape={self.normalized_shape}, eps={self.eps}"


class StackedTables(nn.Module):
    """M copies of an embedding table's weight, stacked (M, rows, width): member m's copy is
    ``weight[m]``."""

    def __init__(self, num_members: int, rows: int, width: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_members, rows, width, device=device, dtype=dtype))

    @classmethod
    def from_embeddings(cls, tables: Sequence[nn.Embedding]) -> StackedTables:
        first = tables[0].weight
        stacked = cls(len(tables), *first.shape, device=first.device, dtype=first.dtype)
        with torch.no_grad():
            stacked.weight.copy_(torch.stack([t.weight for t in tables]))
        return stacked

    @classmethod
    def empty_like(cls, module: nn.Embedding, num_members: int) -> StackedTables:
        """M tables shaped like ``module``'s, weights unset (a saved model fills them)."""
        return cls(num_members, *module.weight.shape)


class MemberHeadBias(StackedTables):
    """M tables of per-head attention-score biases (MPNet's relative position buckets x heads),
    looked up together: channel ``m * H + h`` of the output is member m's head h. The fused
    attention reads each member's channels (`FusedMultiHeadAttention`'s ``bias_stride``)."""

    layout_kind: ClassVar[str] = "member_head_bias"

    def __init__(self, num_members: int, num_buckets: int, num_heads: int, device=None, dtype=None) -> None:
        super().__init__(num_members, num_buckets, num_heads, device=device, dtype=dtype)
        self.num_members, self.num_buckets, self.num_heads = num_members, num_buckets, num_heads

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        table = self.weight.transpose(0, 1).reshape(self.num_buckets, -1)  # (buckets, M * H)
        return F.embedding(index, table)

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, num_buckets={self.num_buckets}, num_heads={self.num_heads}"


class PerMemberModule(nn.Module):
    """Exact fallback: M copies of a module, each run on its member's rows (a loop over M).

    Tensor arguments whose first dimension is a multiple of M are split by member; other
    arguments are passed to every copy unchanged. Outputs (tensors or tuples of tensors) are
    concatenated back along the first dimension.
    """

    layout_kind: ClassVar[str] = "per_member"

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(modules)

    def __getattr__(self, name: str):
        """Attributes the host model reads (e.g. ``embeddings.patch_embeddings``) come from member 0."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            members = self._modules.get("members")
            if members is None or not len(members):
                raise
            return getattr(members[0], name)

    @classmethod
    def empty_like(cls, module: nn.Module, num_members: int) -> PerMemberModule:
        return cls([copy.deepcopy(module) for _ in range(num_members)])

    def forward(self, *args, **kwargs):
        num = len(self.members)
        batch = _stacked_rows(args, kwargs)
        if batch is None or batch % num:
            raise InputError(f"PerMemberModule needs a tensor input with a multiple of {num} rows")
        chunk = batch // num

        def part(value, m):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
                return value[m * chunk : (m + 1) * chunk]
            return value

        outputs = [
            module(*(part(a, m) for a in args), **{k: part(v, m) for k, v in kwargs.items()})
            for m, module in enumerate(self.members)
        ]
        if isinstance(outputs[0], torch.Tensor):
            return torch.cat(outputs)
        if isinstance(outputs[0], tuple):
            return tuple(
                torch.cat(items) if isinstance(items[0], torch.Tensor) else items[0]
                for items in zip(*outputs, strict=True)
            )
        raise TypeError(f"PerMemberModule cannot stack outputs of type {type(outputs[0]).__name__}")


def _stacked_rows(args: tuple, kwargs: dict) -> int | None:
    """dim 0 of the first tensor argument; never converted with ``int`` (it stays symbolic under
    ``torch.export``, so an exported graph keeps a dynamic batch axis)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None
