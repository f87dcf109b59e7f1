"""`HydraConfig`: what Hugging Face's Auto classes read from a saved Hydra model, member or ensemble.

Every classifier folder the library saves (a fused Hydra model, a pruned member, an ensemble of
members) also holds a ``config.json`` of ``model_type`` ``"hydra-ensembles"``. It only routes
``AutoConfig``/``AutoModelFor...Classification``/``pipeline`` to `serving.HydraForSequenceClassification`
(or ``...ForImageClassification``), whose ``from_pretrained`` rebuilds the model from the library's
own checked files; the class names are read from those files too, never from ``config.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from ._imports import first_use
from .errors import InputError
from .saving.files import atomic_write_json
from .saving.formats import HF_CONFIG_NAME, classifier_kinds

MODEL_TYPE = "hydra-ensembles"


class HydraConfig(PretrainedConfig):
    """A saved model's format (``saved_format``: a registered classifier format, `saving.formats`:
    fused, member, ensemble, ...), the family of the model
    it was made from (``base_model_type``) and its classes (``id2label``)."""

    model_type = MODEL_TYPE

    def __init__(self, saved_format: str = "fused", base_model_type: str | None = None, **kwargs: Any):
        first_use(HydraConfig)  # the serving classes, and with them every saved format, registered
        try:
            super().__init__(**kwargs)
        except (AttributeError, TypeError) as exc:  # e.g. class names that are no mapping
            raise InputError(
                f"a malformed {HF_CONFIG_NAME} of a hydra-ens folder ({exc}); it only routes the Auto "
                "classes, so saving the model again restores it"
            ) from None
        if saved_format not in classifier_kinds():
            raise InputError(f"saved_format must be one of {classifier_kinds()}, got {saved_format!r}")
        self.saved_format = saved_format
        self.base_model_type = base_model_type

    @classmethod
    def describing(cls, base_config: PretrainedConfig, saved_format: str) -> HydraConfig:
        """The config of a model saved as ``saved_format`` whose own configuration is ``base_config``."""
        return cls(
            saved_format=saved_format,
            base_model_type=getattr(base_config, "model_type", None),
            id2label=dict(getattr(base_config, "id2label", None) or {}),
            problem_type="single_label_classification",
        )


def register_config() -> None:
    """Register `HydraConfig` with ``AutoConfig`` (idempotent)."""
    AutoConfig.register(MODEL_TYPE, HydraConfig, exist_ok=True)


def write_hf_config(path: str | os.PathLike, base_config: Any, saved_format: str) -> Path | None:
    """Write ``config.json`` (a `HydraConfig`) into ``path`` before the model's own files, so that
    the Auto classes and ``pipeline`` find the model; nothing for a model without a Hugging Face
    configuration."""
    if not isinstance(base_config, PretrainedConfig):
        return None
    config = HydraConfig.describing(base_config, saved_format)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path / HF_CONFIG_NAME, config.to_dict())


register_config()  # saved models load with AutoConfig once this module is imported (see `hydra_ensembles`)
