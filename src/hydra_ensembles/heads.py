"""`HeadSet`: which attention heads a pruned member keeps, per layer.

A head set is a value: immutable, hashable, JSON round-trippable. Layers it does not name keep
all their heads, so ``HeadSet({})`` is the unpruned model. Indices always refer to the heads of
the *original* (unpruned) model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import InputError


class HeadSetError(InputError):
    """A head set is malformed or does not fit a model."""


class HeadSet:
    """Per-layer kept attention heads (ragged: 0..H heads per layer).

    >>> hs = HeadSet({0: [0, 2, 3], 1: [1], 2: []})
    >>> hs.kept(1, num_heads=4)
    (1,)
    >>> hs.kept(5, num_heads=4)  # a layer not named keeps all heads
    (0, 1, 2, 3)
    """

    __slots__ = ("_layers",)

    def __init__(self, layers: Mapping[int | str, Iterable[int]] | None = None) -> None:
        parsed: dict[int, tuple[int, ...]] = {}
        for key, heads in (layers or {}).items():
            layer = _as_index(key, "layer")
            if layer in parsed:
                raise HeadSetError(f"layer {layer} is named twice")
            heads = [_as_index(h, f"head in layer {layer}") for h in heads]
            if len(set(heads)) != len(heads):
                dup = sorted({h for h in heads if heads.count(h) > 1})
                raise HeadSetError(f"duplicate heads {dup} in layer {layer}")
            parsed[layer] = tuple(sorted(heads))
        self._layers = dict(sorted(parsed.items()))

    # ----------------------------------------------------------------- constructors
    @classmethod
    def full(cls, original_heads_per_layer: Sequence[int]) -> HeadSet:
        """Every head of every layer, written out explicitly."""
        return cls({layer: range(h) for layer, h in enumerate(original_heads_per_layer)})

    @classmethod
    def without(cls, removed: Iterable[tuple[int, int]], original_heads_per_layer: Sequence[int]) -> HeadSet:
        """Every head of a model with ``original_heads_per_layer`` heads but the ``(layer, head)`` pairs
        in ``removed``."""
        gone = set(removed)
        return cls(
            {
                layer: [h for h in range(n) if (layer, h) not in gone]
                for layer, n in enumerate(original_heads_per_layer)
            }
        )

    @classmethod
    def from_mask(cls, mask: Sequence[Sequence[bool | int | float]]) -> HeadSet:
        """From a (layers, heads) 0/1 mask: nonzero means kept. NaN (or any value that is not a
        finite number) is refused: it is truthy, so it would silently keep its head."""
        rows = [[float(v) for v in row] for row in mask]
        bad = [
            (layer, h) for layer, row in enumerate(rows) for h, v in enumerate(row) if not math.isfinite(v)
        ]
        if bad:
            raise HeadSetError(f"the mask holds NaN or Inf at (layer, head) {bad[0]}: it must be 0 or 1")
        return cls({layer: [h for h, v in enumerate(row) if v] for layer, row in enumerate(rows)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HeadSet:
        return cls(data)

    @classmethod
    def from_json(cls, text: str) -> HeadSet:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HeadSetError(f"not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise HeadSetError("a head set's JSON must be an object mapping layer -> list of heads")
        return cls(data)

    # ----------------------------------------------------------------- queries
    @property
    def layers(self) -> dict[int, tuple[int, ...]]:
        """The explicitly named layers (a copy)."""
        return dict(self._layers)

    def kept(self, layer: int, num_heads: int) -> tuple[int, ...]:
        """Heads kept in ``layer`` of a model whose layer has ``num_heads`` heads."""
        return self._layers.get(layer, tuple(range(num_heads)))

    def resolve(self, original_heads_per_layer: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Kept heads for every layer of a model; validates indices against it."""
        self.validate(original_heads_per_layer)
        return tuple(self.kept(layer, h) for layer, h in enumerate(original_heads_per_layer))

    def validate(self, original_heads_per_layer: Sequence[int]) -> None:
        """Raise `HeadSetError` unless every named layer and head exists in the model."""
        num_layers = len(original_heads_per_layer)
        for layer, heads in self._layers.items():
            if layer >= num_layers:
                raise HeadSetError(f"layer {layer} out of range: the model has {num_layers} layers")
            bad = [h for h in heads if h >= original_heads_per_layer[layer]]
            if bad:
                raise HeadSetError(
                    f"head index {bad[0]} out of range in layer {layer}: "
                    f"the layer has {original_heads_per_layer[layer]} heads "
                    f"(0..{original_heads_per_layer[layer] - 1})"
                )

    def num_kept(self, original_heads_per_layer: Sequence[int]) -> int:
        return sum(len(k) for k in self.resolve(original_heads_per_layer))

    def mask(self, original_heads_per_layer: Sequence[int]) -> list[list[int]]:
        """(layers, max heads) 0/1 list: 1 where the head is kept."""
        width = max(original_heads_per_layer, default=0)
        resolved = self.resolve(original_heads_per_layer)
        return [[int(h in set(kept)) for h in range(width)] for kept in resolved]

    def is_subset_of(self, other: HeadSet, original_heads_per_layer: Sequence[int]) -> bool:
        mine, theirs = self.resolve(original_heads_per_layer), other.resolve(original_heads_per_layer)
        return all(set(a) <= set(b) for a, b in zip(mine, theirs, strict=True))

    def jaccard(self, other: HeadSet, original_heads_per_layer: Sequence[int]) -> float:
        """Jaccard similarity of the two sets of (layer, head) pairs."""
        a = {(lay, h) for lay, ks in enumerate(self.resolve(original_heads_per_layer)) for h in ks}
        b = {(lay, h) for lay, ks in enumerate(other.resolve(original_heads_per_layer)) for h in ks}
        return len(a & b) / len(a | b) if a | b else 1.0

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, list[int]]:
        return {str(layer): list(heads) for layer, heads in self._layers.items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    # ----------------------------------------------------------------- value semantics
    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeadSet) and self._layers == other._layers

    def __hash__(self) -> int:
        return hash(tuple(self._layers.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{layer}: {list(h)}" for layer, h in self._layers.items())
        return f"HeadSet({{{inner}}})"


def _as_index(value: Any, what: str) -> int:
    """Parse a non-negative integer index (JSON keys arrive as strings)."""
    if isinstance(value, bool):
        raise HeadSetError(f"{what} must be an integer, got {value!r}")
    if isinstance(value, str):
        if not value.strip().isdigit():
            raise HeadSetError(f"{what} must be a non-negative integer, got {value!r}")
        value = int(value)
    try:
        index = int(value)
    except (TypeError, ValueError):
        raise HeadSetError(f"{what} must be an integer, got {value!r}") from None
    if index != value:
        raise HeadSetError(f"{what} must be an integer, got {value!r}")
    if index < 0:
        raise HeadSetError(f"{what} must be non-negative, got {index}")
    return index
