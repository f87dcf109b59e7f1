"""Saved Hydra models, members and ensembles as Hugging Face models.

Importing ``hydra_ensembles`` registers `HydraConfig` with ``AutoConfig`` (when transformers' Auto
configuration loads); the classes below are
registered with ``AutoModelForSequenceClassification`` and ``AutoModelForImageClassification``
when this module is imported, which the first `HydraConfig` does (`_imports.on_first_use`),
so a folder the library saved loads with the Auto classes and serves through ``transformers.pipeline``::

    model = AutoModelForSequenceClassification.from_pretrained("built/hydra")
    classify = pipeline("text-classification", model="built/hydra")

The model's ``logits`` are the log of the ensemble's calibrated probabilities (the mean of the
members' softmaxes at the saved temperature): a softmax of them, as every pipeline applies, gives
those probabilities exactly, and their argmax is the ensemble's prediction. ``logits_per_member``
keeps the members' own logits (batch first) and ``features_per_member`` what each member's output
layer read, for the uncertainty fields, which the pipelines of `serving.pipelines` add per input.
Where the calibration flags on a feature score, ``ood_score_per_member`` and ``ood_score`` (their
mean) are that score, computed in float64 from the saved feature statistics. Loading goes through
the library's checked loaders (safetensors and JSON, checksums verified); ``config.json`` only
routes the Auto classes here.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)
from transformers.utils import ModelOutput

from ..calibration.calibration import Calibration
from ..calibration.fit import saved_calibration
from ..configuration import HydraConfig, register_config
from ..errors import InputError
from ..loading import load_saved
from ..members.ensemble import as_ensemble, unwrapped
from ..ood.registry import feature_scores
from ..outputs import ensemble_log_probs
from ..precision import check_precision, model_device, resolve_precision
from ..saving.formats import SAVED_FORMATS, format_of

__all__ = [
    "HydraClassifierOutput",
    "HydraForImageClassification",
    "HydraForSequenceClassification",
    "HydraPreTrainedModel",
    "register_auto_classes",
    "serving_precision",
]


@dataclass
class HydraClassifierOutput(ModelOutput):
    """``logits`` (batch, classes): log of the calibrated ensemble probabilities;
    ``logits_per_member`` (batch, members, classes): the members' logits before calibration;
    ``features_per_member`` (batch, members, width): what each member's output layer read;
    ``ood_score`` (batch,) and ``ood_score_per_member`` (batch, members): the calibration's
    feature score (float64), where it flags on one; ``layer_features_per_member`` (batch,
    members, layers, width): each member's pooled token after every layer, where that score
    reads them (``mds_layers``); ``loss``: the NLL of ``labels`` under the calibrated ensemble,
    when given."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    logits_per_member: torch.Tensor | None = None
    features_per_member: torch.Tensor | None = None
    ood_score: torch.Tensor | None = None
    ood_score_per_member: torch.Tensor | None = None
    layer_features_per_member: torch.Tensor | None = None


def serving_precision(model: nn.Module, precision: str = "auto") -> contextlib.AbstractContextManager:
    """The autocast a served forward pass of ``model`` runs under: ``precision`` resolved as
    ``hydra-ens predict`` resolves it (`precision.resolve_precision`: ``auto`` is bf16 where the
    device computes it natively, which is also what ``build`` and ``finetune`` fit the calibration
    in), so a model served here gives the probabilities ``predict`` writes on the same machine.
    fp32 leaves the weights' own dtype (a model cast with ``dtype=`` computes in it)."""
    device = model_device(model)
    return resolve_precision(precision, device).autocast(device)


class HydraPreTrainedModel(PreTrainedModel):
    """A saved Hydra model, member or ensemble of members behind Hugging Face's model interface.

    ``ensemble`` is the library's model (`HydraModel`, `DeepEnsemble`, a pruned member or any
    classifier `members.as_ensemble` takes); ``calibration`` its `Calibration` (read from the saved
    model; None: temperature 1 and no OOD flag); ``precision`` what the forward pass computes in
    (``"auto"``: as ``hydra-ens predict`` on this machine; `serving_precision`). Build one with
    `from_pretrained` (a folder) or `from_ensemble` (a model in memory). A calibration that flags
    on a score reading every layer (``mds_layers``) turns the wrapped model's ``record_layers``
    on: its forward passes then also return the members' layer tokens.
    """

    config_class = HydraConfig
    base_model_prefix = "ensemble"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(
        self, config: HydraConfig, ensemble: nn.Module | None = None, calibration: Calibration | None = None
    ) -> None:
        super().__init__(config)
        if ensemble is None:
            raise TypeError(
                f"{type(self).__name__} wraps a trained model: build it with from_pretrained(path) "
                "or from_ensemble(model)"
            )
        self.ensemble = as_ensemble(ensemble)
        self.calibration = calibration
        self.precision = "auto"
        if calibration is not None and calibration.flag.reads_layers:  # its flag score reads every layer
            if not hasattr(self.ensemble, "record_layers"):
                raise InputError(
                    f"the calibration flags on {calibration.flag.score}, which reads every layer's features, "
                    f"and a {type(self.ensemble).__name__} does not record them"
                )
            self.ensemble.record_layers = True

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: every weight comes from the wrapped model, never from an initialiser."""

    @property
    def temperature(self) -> float:
        return self.calibration.temperature if self.calibration is not None else 1.0

    @classmethod
    def from_ensemble(cls, model: nn.Module, saved_format: str | None = None) -> HydraPreTrainedModel:
        """Wrap a model in memory with the calibration recorded in it (`calibration.calibrate`)."""
        base = model.config
        config = HydraConfig.describing(base, saved_format or format_of(model).kind)
        config.name_or_path = getattr(base, "name_or_path", "")
        return cls(config, model, saved_calibration(model))

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *args: Any,
        config: HydraConfig | None = None,
        dtype: Any = None,
        torch_dtype: Any = None,
        device_map: Any = None,
        precision: str = "auto",
        **kwargs: Any,
    ) -> HydraPreTrainedModel:
        """A folder written by the library (`HydraModel.save_pretrained`, `save_member`,
        `DeepEnsemble.save_pretrained`, ``hydra-ens build``), loaded by its checked loader.
        ``dtype`` (``"auto"``/None: as saved) casts the weights after the calibration was read;
        ``device_map`` may name one device; ``precision`` is what the forward pass computes in
        (`serving_precision`). Other Hugging Face loading options are ignored."""
        folder = Path(pretrained_model_name_or_path)
        if not folder.is_dir():
            raise OSError(
                f"{pretrained_model_name_or_path} is not a folder saved by hydra-ensembles (hub ids are "
                "not fetched: download the folder first)"
            )
        model, saved_format = load_saved(folder)
        wrapped = cls.from_ensemble(model, saved_format)
        wrapped.config.name_or_path = str(pretrained_model_name_or_path)
        wrapped.precision = check_precision(precision)
        dtype = dtype if dtype is not None else torch_dtype
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            wrapped.to(dtype)
        if isinstance(device_map, (str, torch.device, int)):
            wrapped.to(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")
        return wrapped.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Save in the library's format the model was loaded from (Hugging Face saving options
        are ignored); the calibration stays recorded in the model's configuration."""
        model = unwrapped(self.ensemble)  # a BatchEnsemble, Packed, MIMO or heads model: itself
        if self.config.saved_format == "member" and len(getattr(model, "members", ())) == 1:
            model = model.members[0]  # a member is served as an ensemble of one
        SAVED_FORMATS[self.config.saved_format].save(model, Path(save_directory))

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> HydraClassifierOutput:
        inputs = {k: v for k, v in inputs.items() if v is not None}
        with serving_precision(self, self.precision):
            out = self.ensemble(**inputs)
        member_logits, features = out.member_logits, out.member_features  # (M, B, C), (M, B, D)
        logits = ensemble_log_probs(member_logits.float() / self.temperature)
        loss = None if labels is None else F.nll_loss(logits, labels.to(logits.device))
        scores = None
        calibration = self.calibration
        if (
            calibration is not None
            and calibration.flag.statistics is not None
            and calibration.flag.score in feature_scores()
        ):
            scores = calibration.flag.statistics.member_scores(
                calibration.flag.score, features, member_logits.float(), out.layer_features
            )
        layers = out.layer_features
        return HydraClassifierOutput(
            loss=loss,
            logits=logits,
            logits_per_member=member_logits.transpose(0, 1),
            features_per_member=None if features is None else features.transpose(0, 1),
            ood_score=None if scores is None else scores.mean(0),
            ood_score_per_member=None if scores is None else scores.transpose(0, 1),
            layer_features_per_member=None if layers is None else layers.transpose(0, 1),
        )


class HydraForSequenceClassification(HydraPreTrainedModel):
    """A saved Hydra text classifier for ``AutoModelForSequenceClassification`` and pipelines."""


class HydraForImageClassification(HydraPreTrainedModel):
    """A saved Hydra image classifier for ``AutoModelForImageClassification`` and pipelines."""

    main_input_name = "pixel_values"


def register_auto_classes() -> None:
    """Register `HydraConfig` and the classes above with ``transformers``' Auto classes (once)."""
    register_config()
    AutoModelForSequenceClassification.register(HydraConfig, HydraForSequenceClassification, exist_ok=True)
    AutoModelForImageClassification.register(HydraConfig, HydraForImageClassification, exist_ok=True)
