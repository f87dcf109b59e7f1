"""Choosing heads: Taylor importance and greedy circuit extraction."""

from .circuit import (
    CircuitConfig,
    CircuitError,
    CircuitOrder,
    extract_circuit,
    objective_value,
    removal_ranking,
)
from .taylor import taylor_head_set, taylor_scores

__all__ = [
    "CircuitConfig",
    "CircuitError",
    "CircuitOrder",
    "extract_circuit",
    "objective_value",
    "removal_ranking",
    "taylor_head_set",
    "taylor_scores",
]
