"""Head rankings on disk: what ``hydra-ens score`` writes and ``hydra-ens build`` reads."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..adapters import get_adapter
from ..errors import InputError
from ..saving.files import read_json
from .circuit import CircuitOrder
from .ranking import least_useful_first


def read_ranking(path: str | os.PathLike, model: nn.Module) -> torch.Tensor | CircuitOrder:
    """The head ranking a scores file holds (Taylor scores or a circuit order), checked against
    ``model``'s heads per layer. Raises ValueError, naming the file, where it is no scores file,
    is damaged or ranks another model."""
    data = read_json(path, "scores file")
    method = data.get("method") if isinstance(data, dict) else None
    if method not in ("taylor", "circuit"):
        raise InputError(f"{path} is not a file written by hydra-ens score")
    heads = list(get_adapter(model).original_heads_per_layer(model))
    try:
        ranking = (
            torch.tensor(data["scores"], dtype=torch.float64)
            if method == "taylor"
            else CircuitOrder.from_dict(data)
        )
        ranked_heads = least_useful_first(ranking)[1]  # heads per layer the ranking covers
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path} is damaged or does not fit {type(model).__name__}: {exc}") from None
    if ranked_heads != heads:
        raise InputError(f"{path} ranks a model with heads per layer {ranked_heads}; this one has {heads}")
    return ranking
