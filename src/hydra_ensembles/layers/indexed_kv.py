"""Grouped-query attention whose query heads read their key/value heads through an index.

In a decoder LLM (Llama, Mistral, Qwen, Gemma) query head h reads key/value head
``h // group``, and Hugging Face's attention code repeats every key/value head ``group`` times
(``repeat_kv``). Head pruning removes query heads one by one, so the groups become ragged (a
key/value head may keep 3 of its 4 query heads, its neighbour 1), which no ``num_key_value_groups``
can describe. `IndexedKVAttention` keeps the family's own attention module and its Hugging Face
forward (projections, q/k norms, rotary embeddings, scaling, sliding windows, soft-capping all
run unchanged) and swaps one step: the attention function, which reads member m's query slot h
against key/value slot ``kv_index[m, h]`` instead of repeating key/value heads uniformly.

The same module serves a pruned member (one member, plain ``nn.Linear`` projections) and M
members fused (`GroupedLinear` projections over a member-stacked batch, each member's heads
padded to the largest member: padded query slots have zero weights and meet zero W_O columns,
padded key/value slots are read by no query, so the result is exact).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .swapped import SwappedAttention

ATTENTION_FUNCTION = "hydra_indexed_kv"
"""The name `IndexedKVAttention` registers its attention function under in ``transformers``'
``AttentionInterface`` (the module's own configuration copy selects it; the model's is untouched)."""


def expand_kv(states: torch.Tensor, kv_index: torch.Tensor) -> torch.Tensor:
    """(rows, KV, T, d) key or value states of a member-stacked batch -> (rows, H, T, d): member m's
    query slot h gets key/value slot ``kv_index[m, h]`` (``kv_index``: (M, H))."""
    members, heads = kv_index.shape
    index = kv_index.to(states.device)
    if members == 1:
        return states.index_select(1, index[0])
    grouped = states.unflatten(0, (members, -1))  # (M, B, KV, T, d)
    shape = (members, grouped.shape[1], heads, *grouped.shape[3:])
    return grouped.gather(2, index[:, None, :, None, None].expand(shape)).flatten(0, 1)


def indexed_kv_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The attention function of `IndexedKVAttention`: key/value heads expanded by the module's
    ``kv_index``, then the attention function the model was configured with (SDPA, eager, ...),
    told that every query head has its own key/value head."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend = ALL_ATTENTION_FUNCTIONS.get_interface(module.inner_implementation, module.eager_attention)
    return attend(
        module,
        query,
        expand_kv(key, module.kv_index),
        expand_kv(value, module.kv_index),
        attention_mask,
        **kwargs,
    )


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_FUNCTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_FUNCTION, indexed_kv_attention)


class IndexedKVAttention(SwappedAttention):
    """A decoder's attention module with ``kv_index`` (M, H_max): member m's query slot h reads
    key/value slot ``kv_index[m, h]``. ``attention`` is the module it stands in for (its class's
    forward runs, its attributes and sub-modules are kept); ``modules`` replaces sub-modules by
    name (the projections, per-member q/k norms). ``heads_per_member`` and
    ``kv_heads_per_member`` count each member's real (unpadded) heads."""

    def __init__(
        self,
        attention: nn.Module,
        modules: Mapping[str, nn.Module],
        kv_index: torch.Tensor,
        heads_per_member: Sequence[int],
        kv_heads_per_member: Sequence[int],
    ) -> None:
        super().__init__(attention, modules, heads_per_member)
        _register()
        if isinstance(attention, IndexedKVAttention):  # re-pruned: the family's kernel already routed
            self.eager_attention = attention.eager_attention
            self.inner_implementation = attention.inner_implementation
        else:
            self.eager_attention = getattr(
                sys.modules[type(attention).__module__], "eager_attention_forward", None
            )
            self.inner_implementation = attention.config._attn_implementation or "eager"
            self.config = copy.copy(attention.config)  # routes this module's attention function only
            self.config._attn_implementation_internal = ATTENTION_FUNCTION
        self.num_key_value_groups = 1  # key/value heads come expanded to the query heads
        self.kv_heads_per_member = tuple(int(h) for h in kv_heads_per_member)
        self.register_buffer("kv_index", kv_index.to(torch.long), persistent=False)

    def padding(self) -> int:
        h_max, kv_max = max(self.heads_per_member), max(self.kv_heads_per_member)
        padded_q = sum(h_max - h for h in self.heads_per_member) * self.head_dim
        padded_kv = sum(kv_max - h for h in self.kv_heads_per_member) * self.head_dim
        total = padded_q * self.o_proj.out_features
        for name, rows in (("q_proj", padded_q), ("k_proj", padded_kv), ("v_proj", padded_kv)):
            linear = getattr(self, name)
            total += rows * (linear.in_features + (linear.bias is not None))
        return total

    def extra_repr(self) -> str:
        return (
            f"heads_per_member={list(self.heads_per_member)}, "
            f"kv_heads_per_member={list(self.kv_heads_per_member)}"
        )
