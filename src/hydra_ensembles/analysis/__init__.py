"""The paper's analysis as tools: Proposition 1's conditions (`curvature`), what heads represent
(`representations`), and the studies `hydra-ens analyze` runs (`studies`)."""

from .curvature import (
    Proposition1Result,
    attention_parameters,
    gradient,
    hessian_vector_products,
    hutchinson_diagonal,
    proposition1,
    pruning_perturbation,
)

STUDIES = ("prop1", "heads", "members", "merge")
"""The studies `hydra-ens analyze` runs: Proposition 1's conditions, what heads represent, the
number of members, and merged vs exact fusion."""

__all__ = [
    "STUDIES",
    "Proposition1Result",
    "attention_parameters",
    "gradient",
    "hessian_vector_products",
    "hutchinson_diagonal",
    "proposition1",
    "pruning_perturbation",
]
