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

__all__ = [
    "Proposition1Result",
    "attention_parameters",
    "gradient",
    "hessian_vector_products",
    "hutchinson_diagonal",
    "proposition1",
    "pruning_perturbation",
]
