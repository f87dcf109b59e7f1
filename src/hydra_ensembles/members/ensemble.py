"""Every kind of ensemble as one module with one output (`outputs.EnsembleOutput`).

`DeepEnsemble` runs independent models one after another (deep ensembles, LoRA-Ensembles,
single pruned models, a single model as an ensemble of one), `MCDropout` samples one model with
dropout on, `StackedMembers` reads a model that answers for M members at once (BatchEnsemble).
A fused `HydraModel` already answers this way. `as_ensemble` picks the wrapper, so prediction,
evaluation and calibration have one code path for all of them.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..baselines.registry import stacked_members
from ..batching import batch_rows, member_stacked
from ..configuration import write_hf_config
from ..errors import InputError
from ..hashing import config_digest
from ..ood.detectors import STATISTICS_NAME
from ..ood.features import FeatureError, FeatureTap
from ..ood.storage import read_statistics, statistics_digest
from ..outputs import EnsembleOutput
from ..saving.files import atomic_write_json, read_json
from ..saving.formats import SavedFormat, check_companions, companion_digests, register_saved_format
from ..saving.metadata import read_metadata, write_metadata
from .storage import CONFIG_NAME as MEMBER_CONFIG
from .storage import MemberLoadError, load_member, save_member

CONFIG_NAME = "ensemble_config.json"
FORMAT = "hydra-ensembles/ensemble"
FORMAT_VERSION = 2
"""2: the index carries its own checksum and each member config's (1: neither; still read)."""


class DeepEnsemble(nn.Module):
    """Independent models whose softmaxes are averaged; each runs on the whole batch."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        if not models:
            raise InputError("an ensemble needs at least one model")
        nested = [type(m).__name__ for m in models if hasattr(m, "num_members") or stacked_members(m) > 1]
        if nested:
            raise InputError(
                f"an explicit ensemble takes single models, and {nested[0]} answers for several members "
                "already: predict it on its own, or list its members"
            )
        self.members = nn.ModuleList(models)
        self.record_layers = False  # each member's pooled token after every layer (`FeatureTap`)
        # the members' configuration (family, classes), with the ensemble's own calibration
        # (`calibration.calibrate`; saved in its index file), never a member's
        first = getattr(models[0], "config", None)
        self.config = copy.deepcopy(first) if first is not None else SimpleNamespace()
        write_metadata(self.config, calibration=None)

    @property
    def num_members(self) -> int:
        return len(self.members)

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> EnsembleOutput:
        logits, features, layers = [], [], []
        for member in self.members:
            if hasattr(member, "features_and_logits"):  # a dual encoder: its unit input embedding
                feature, member_logits = member.features_and_logits(**inputs)
                logits.append(member_logits)
                features.append(feature)
                continue
            tap = _tap(member)
            if tap is not None:
                tap.every_layer = self.record_layers
            with tap if tap is not None else contextlib.nullcontext():
                logits.append(member(**inputs).logits)
            if tap is not None:
                features.append(tap.features(inputs, logits[-1].shape[0])[0])
                if self.record_layers:
                    layers.append(tap.layer_features(inputs, logits[-1].shape[0])[0])
        stacked = torch.stack(features) if len(features) == len(logits) else None
        layered = torch.stack(layers) if layers and len(layers) == len(logits) else None
        return EnsembleOutput.from_member_logits(torch.stack(logits), labels, stacked, layered)

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Each member as a saved member (``member-<m>/``), then ``ensemble_config.json``."""
        path = Path(path)
        names = [f"member-{m}" for m in range(self.num_members)]
        for name, member in zip(names, self.members, strict=True):
            save_member(member, path / name)
        metadata = read_metadata(self)
        return write_ensemble_index(path, names, self.config, metadata.calibration, metadata.statistics)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DeepEnsemble:
        """An ensemble written by `save_pretrained` (every member checked by its checksums)."""
        config = read_ensemble_index(path)
        ensemble = cls([load_member(Path(path) / name) for name in config["members"]])
        write_metadata(ensemble, calibration=config.get("calibration"))
        read_statistics(ensemble, path, MemberLoadError)
        return ensemble


def read_ensemble_index(path: str | os.PathLike) -> dict[str, Any]:
    """The checked index of a saved ensemble (`write_ensemble_index`): its members' folder names
    (``members``) and its calibration where it has one. MemberLoadError where it is not one, is
    of an unknown format version, names a member twice, or (format 2) does not match its own
    checksum or names members whose saved configs changed since (a member folder swapped)."""
    path = Path(path)
    file = path / CONFIG_NAME
    try:
        config = read_json(file, "ensemble config")
    except ValueError as exc:
        raise MemberLoadError(f"{exc}: not a saved ensemble (or the save did not finish)") from None
    names = config.get("members") if isinstance(config, dict) and config.get("format") == FORMAT else None
    if not names or not all(isinstance(n, str) and "/" not in n and n not in (".", "..") for n in names):
        raise MemberLoadError(f"{file} is not a {FORMAT} file")
    version = config.get("format_version", 1)
    if version not in (1, FORMAT_VERSION):
        raise MemberLoadError(
            f"{file} has format version {version}, this library reads [1, {FORMAT_VERSION}]"
        )
    if len(set(names)) != len(names):
        raise MemberLoadError(f"{file} names a member twice: an ensemble of copies measures no disagreement")
    if version >= 2:
        if config.get("config_sha256") != config_digest(config):
            raise MemberLoadError(f"{file} does not match its own checksum: it was modified after saving")
        check_companions(path, config.get("files_sha256", {}), CONFIG_NAME, MemberLoadError)
        members = config.get("members_sha256", {})
        for name in names:
            saved = (
                read_json(path / name / MEMBER_CONFIG, "member config")
                if (path / name / MEMBER_CONFIG).is_file()
                else {}
            )
            if members.get(name) != saved.get("config_sha256"):
                raise MemberLoadError(f"{path / name} is not the member {file} was saved with")
    return config


def write_ensemble_index(
    path: str | os.PathLike,
    names: Sequence[str],
    config: Any,
    calibration: dict[str, Any] | None = None,
    statistics: Any = None,
) -> Path:
    """Record that the saved members ``path/<name>`` form one ensemble (written after them, so
    its presence means every member is complete), with the ensemble's calibration where it has
    one (and the feature ``statistics`` it names, written first): what
    `DeepEnsemble.from_pretrained` reads. Then the ``config.json`` (from the members'
    configuration ``config``) that routes ``transformers``' Auto classes to it."""
    path = Path(path)
    members = {
        name: read_json(path / name / MEMBER_CONFIG, "member config").get("config_sha256") for name in names
    }
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "members": list(names),
        "members_sha256": members,
    }
    if calibration is not None:
        index["calibration"] = calibration
        if statistics is not None and statistics_digest(calibration):
            statistics.save(path / STATISTICS_NAME)
    index["files_sha256"] = companion_digests(path, CONFIG_NAME)  # the tokenizer, the statistics
    index["config_sha256"] = config_digest(index)
    atomic_write_json(path / CONFIG_NAME, index)
    write_hf_config(path, config, "ensemble")
    return Path(path)


def has_dropout(model: nn.Module) -> bool:
    """Whether training mode makes ``model`` random: a dropout module with p > 0, attention
    modules that drop attention probabilities (a float ``attention_dropout`` or ``dropout`` > 0),
    or stochastic depth (``drop_prob`` > 0)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name in ("attention_dropout", "dropout", "drop_prob"):
            rate = getattr(module, name, None)
            if isinstance(rate, float) and rate > 0:
                return True
    return False


class MCDropout(nn.Module):
    """MC dropout: ``samples`` forward passes of one model with dropout on, as members."""

    def __init__(self, model: nn.Module, samples: int) -> None:
        super().__init__()
        if samples < 1:
            raise InputError(f"MC dropout needs at least one sample, got {samples}")
        if not has_dropout(model):
            raise InputError(
                f"MC dropout needs dropout, but this {type(model).__name__} has none with p > 0: "
                "its samples would all be the same model"
            )
        self.model, self.samples = model, int(samples)

    @property
    def num_members(self) -> int:
        return self.samples

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> EnsembleOutput:
        was_training = self.model.training
        self.model.train()
        tap = _tap(self.model, self.samples)
        try:
            with tap if tap is not None else contextlib.nullcontext():
                logits = torch.stack([self.model(**inputs).logits for _ in range(self.samples)])
        finally:
            self.model.train(was_training)
        features = None if tap is None else tap.features(inputs, logits.shape[1])
        return EnsembleOutput.from_member_logits(logits, labels, features)


class StackedMembers(nn.Module):
    """A model that answers for M members at once with (M*B, C) logits (a BatchEnsemble)."""

    def __init__(self, model: nn.Module, num_members: int) -> None:
        super().__init__()
        self.model, self._members = model, int(num_members)

    @property
    def num_members(self) -> int:
        return self._members

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> EnsembleOutput:
        tap = _tap(self.model, self._members)
        with tap if tap is not None else contextlib.nullcontext():
            logits = member_stacked(self.model(**inputs).logits, batch_rows(inputs))
        if logits.shape[0] != self._members:
            raise InputError(f"the model answered for {logits.shape[0]} members, not {self._members}")
        features = None if tap is None else tap.features(inputs, logits.shape[1])
        return EnsembleOutput.from_member_logits(logits, labels, features)


def _tap(model: nn.Module, num_members: int = 1) -> FeatureTap | None:
    """What records ``model``'s features (`ood.features`), or None where its logits are not one
    affine map of one feature vector per member."""
    try:
        return FeatureTap(model, num_members)
    except (FeatureError, TypeError):  # TypeError: a family without an adapter
        return None


Ensemble = nn.Module
"""Anything `as_ensemble` returns: a module with ``num_members`` whose forward gives an
`EnsembleOutput`."""


def as_ensemble(model: nn.Module | Sequence[nn.Module], mc_samples: int = 0) -> Ensemble:
    """``model`` as an ensemble: itself where it is one already (a `HydraModel`, `DeepEnsemble`,
    ...), a list of models as a `DeepEnsemble`, a BatchEnsemble or a model with an ensemble of
    heads (`head_ensemble`) a Packed-Ensemble or a MIMO model as `StackedMembers`, one model
    as an ensemble of one, or, with ``mc_samples``, as `MCDropout`."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        if mc_samples:
            raise InputError("MC dropout samples one model, not a list of models")
        return DeepEnsemble(list(model))
    if hasattr(model, "num_members"):
        if mc_samples:
            raise InputError(f"MC dropout samples a plain model, not a {type(model).__name__}")
        return model
    if mc_samples:
        return MCDropout(model, mc_samples)
    if (members := stacked_members(model)) > 1:
        return StackedMembers(model, members)
    return DeepEnsemble([model])


def unwrapped(ensemble: nn.Module) -> nn.Module:
    """The one model `as_ensemble` wrapped to answer as an ensemble (a model answering for M
    members at once, or one sampled with dropout), else ``ensemble`` itself: what is saved."""
    return ensemble.model if isinstance(ensemble, (StackedMembers, MCDropout)) else ensemble


def _first_member(folder: Path) -> Path:
    """Where a saved ensemble's preprocessor is: its first member's folder."""
    return folder / read_ensemble_index(folder)["members"][0]


register_saved_format(
    SavedFormat(
        "ensemble",
        CONFIG_NAME,
        DeepEnsemble.from_pretrained,
        preprocessor_folder=_first_member,
        model_class=DeepEnsemble,
        save=DeepEnsemble.save_pretrained,
    )
)
