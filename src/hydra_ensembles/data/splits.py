"""Deterministic data splits by a stable hash of each example's id.

The same id always lands in the same split, on every machine and for every method compared,
independent of file order, Python's hash seed, or how many other examples exist.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from ..errors import InputError


def stable_unit(key: str, salt: str = "") -> float:
    """A number in [0, 1) fixed by ``key`` (and ``salt``): SHA-256 based, platform independent."""
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(key: str, fractions: Mapping[str, float], salt: str = "") -> str:
    """The split ``key`` belongs to; ``fractions`` (name -> share) must sum to 1."""
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-9 or any(v < 0 for v in fractions.values()):
        raise InputError(f"split fractions must be non-negative and sum to 1, got {dict(fractions)}")
    u, edge = stable_unit(key, salt), 0.0
    for name, share in fractions.items():
        edge += share
        if u < edge:
            return name
    return list(fractions)[-1]


def split_indices(
    keys: Sequence[str], fractions: Mapping[str, float], salt: str = ""
) -> dict[str, list[int]]:
    """Indices of ``keys`` per split, in input order."""
    out: dict[str, list[int]] = {name: [] for name in fractions}
    for i, key in enumerate(keys):
        out[split_of(key, fractions, salt)].append(i)
    return out


def stable_sample(
    indices: Sequence[int], keys: Sequence[str], limit: int | None, salt: str = ""
) -> list[int]:
    """Up to ``limit`` of ``indices``, chosen by a stable hash of their keys (class-balanced in
    expectation, unlike taking the first ``limit`` of a file listing sorted by class)."""
    ranked = sorted(indices, key=lambda i: stable_unit(keys[i], f"sample:{salt}"))
    return ranked if limit is None else ranked[:limit]
