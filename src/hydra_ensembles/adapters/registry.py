"""The adapter registry: every family's adapter class, in the order `get_adapter` tries them
(the package fills it with the library's families; `register_adapter` puts a new one first)."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import ArchitectureAdapter

ADAPTERS: list[type[ArchitectureAdapter]] = []


def register_adapter(adapter: type[ArchitectureAdapter]) -> type[ArchitectureAdapter]:
    """Add an adapter class (usable as a decorator); later registrations win."""
    ADAPTERS.insert(0, adapter)
    return adapter


def supported_families() -> list[str]:
    return [f"{a.family} ({', '.join(a.model_types)})" for a in ADAPTERS]


def pools_last_token(config) -> bool:
    """Whether a model of this configuration pools the last token that is not its padding id
    (decoder LLM classifiers), so that its inputs must be padded with that id."""
    model_type = getattr(config, "model_type", None)
    return any(a.last_token_pooling and model_type in a.model_types for a in ADAPTERS)


def get_adapter(model: nn.Module) -> ArchitectureAdapter:
    """The adapter for ``model``, or `UnsupportedModelError` naming the supported families."""
    for adapter in ADAPTERS:
        if adapter.matches(model):
            return adapter(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    raise UnsupportedModelError(
        f"unsupported architecture {type(model).__name__} (model_type={model_type!r}); "
        f"supported families: {', '.join(supported_families())}"
    )
