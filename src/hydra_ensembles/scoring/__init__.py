"""Choosing heads: Taylor importance and greedy circuit extraction."""

from .circuit import (
    CircuitConfig,
    CircuitError,
    CircuitOrder,
    extract_circuit,
    objective_value,
    removal_ranking,
)
from .ranking import least_useful_first
from .taylor import taylor_head_set, taylor_scores

__all__ = [
    "CircuitConfig",
    "CircuitError",
    "CircuitOrder",
    "extract_circuit",
    "least_useful_first",
    "objective_value",
    "removal_ranking",
    "taylor_head_set",
    "taylor_scores",
]
