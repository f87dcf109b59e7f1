"""A family's own attention module, run by its own Hugging Face forward, with sub-modules swapped.

Where a family's attention infers its head count from its projections' shapes (decoder LLMs,
ModernBERT), a pruned member and M fused members need no attention code of their own: the
projections are swapped for pruned linears or for `GroupedLinear` layers over a member-stacked
batch (each member's heads padded to the largest member: padded query heads have zero weights
and meet zero W_O columns, so the result is exact), and the family's forward runs unchanged.
`SwappedAttention` is that swap; `FusedQKVAttention` names the packed Q/K/V layout
(``Wqkv``: [Q | K | V] rows per member) for its parameter count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn


class SwappedAttention(nn.Module):
    """``attention`` (a family's attention module, or another `SwappedAttention`) with the
    sub-modules in ``modules`` swapped in by name; its attributes and other sub-modules are kept
    and its class's forward runs. ``heads_per_member``: each member's real (unpadded) heads."""

    def __init__(
        self, attention: nn.Module, modules: Mapping[str, nn.Module], heads_per_member: Sequence[int]
    ) -> None:
        super().__init__()
        for name, value in vars(attention).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, child in attention.named_children():
            self.add_module(name, modules.get(name, child))
        for name, child in modules.items():
            self.add_module(name, child)
        self.forward_of = (
            attention.forward_of if isinstance(attention, SwappedAttention) else type(attention).forward
        )
        self.heads_per_member = tuple(int(h) for h in heads_per_member)

    @property
    def num_members(self) -> int:
        return len(self.heads_per_member)

    def forward(self, *args, **kwargs):
        return self.forward_of(self, *args, **kwargs)

    def padding(self) -> int:
        """Zero parameters that pad ragged members to the largest one."""
        return 0

    def num_effective_parameters(self) -> int:
        """Parameters without the zero padding of ragged members."""
        return sum(p.numel() for p in self.parameters()) - self.padding()

    def extra_repr(self) -> str:
        return f"heads_per_member={list(self.heads_per_member)}"


class FusedQKVAttention(SwappedAttention):
    """`SwappedAttention` whose packed ``Wqkv`` holds each member's [Q | K | V] heads and ``Wo``
    its W_O (ModernBERT's layout); ``head_dim`` is the family's attribute."""

    def padding(self) -> int:
        h_max, wqkv, wo = max(self.heads_per_member), self.Wqkv, self.Wo
        slots = sum(h_max - h for h in self.heads_per_member) * self.head_dim
        return slots * (3 * (wqkv.in_features + (wqkv.bias is not None)) + wo.out_features)
