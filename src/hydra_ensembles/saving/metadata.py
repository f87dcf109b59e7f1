"""What the library records about a model beside Hugging Face's own configuration.

A model the library pruned, trained, calibrated or turned into a baseline's member carries one
`ModelMetadata`. It lives on the model's Hugging Face configuration as ``hydra_*`` fields
(`CONFIG_KEYS`), so ``config.json`` holds it, every saved format writes it with the config, and a
model loaded by ``transformers`` itself keeps it. Code reads it with `read_metadata` and changes
it with `write_metadata`, never by the attribute names.

The one field that is not JSON, ``statistics`` (the OOD feature statistics the calibration was fit
with: tensors), is held by the model itself, not its configuration; its savers write it beside the
weights (`ood.storage`), checked against the digest the calibration records.

Each field is bound to something: ``kept_heads`` and ``base_fingerprint`` to the pruning,
``calibration`` and ``statistics`` to the weights (a model made from a calibrated one starts
without them),
``training`` to the fine-tunes since the pretrained weights, ``max_length`` to the data the model
was fit on, ``member_transforms`` to the baselines' layers (`baselines.registry`: each member
transform registers its key here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..heads import HeadSet, HeadSetError
from .files import read_json

CONFIG_KEYS: dict[str, str] = {
    "kept_heads": "hydra_kept_heads",
    "base_fingerprint": "hydra_base_fingerprint",
    "calibration": "hydra_calibration",
    "training": "hydra_training",
    "max_length": "hydra_max_length",
}
"""Each `ModelMetadata` field's key in the configuration (``member_transforms`` have their own;
``statistics`` is held by the model, under `STATISTICS_ATTRIBUTE`, which nothing else names)."""

STATISTICS_ATTRIBUTE = "hydra_ood_statistics"

TRANSFORM_KEYS: list[str] = []
"""The configuration keys of the member transforms, in registration order (`register_transform_key`)."""


@dataclass(frozen=True)
class ModelMetadata:
    """The library's record on a model. None (or empty): not recorded.

    ``kept_heads``: the original heads a pruned model keeps; ``base_fingerprint``: the unpruned
    model it descends from (`hashing.fingerprint`); ``calibration``: `calibration.Calibration`'s
    dictionary; ``training``: the fine-tuning record (`training.record_training`); ``max_length``:
    the token length the model was trained and calibrated at; ``member_transforms``: each
    baseline transform's record by its key; ``statistics``: the `ood.FeatureStatistics` the
    calibration was fit with (held by the model; None read from a configuration).
    """

    kept_heads: HeadSet | None = None
    base_fingerprint: str | None = None
    calibration: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    max_length: int | None = None
    member_transforms: Mapping[str, Any] = field(default_factory=dict)
    statistics: Any = None

    def to_config(self) -> dict[str, Any]:
        """The configuration fields that record it (unrecorded fields left out)."""
        out = {}
        for name, key in CONFIG_KEYS.items():
            value = getattr(self, name)
            if value is not None:
                out[key] = value.to_dict() if isinstance(value, HeadSet) else value
        return {**out, **{k: v for k, v in self.member_transforms.items() if v is not None}}


def register_transform_key(key: str) -> str:
    """Record ``key`` as a member transform's configuration key (once)."""
    if key in CONFIG_KEYS.values():
        raise ValueError(f"{key!r} is already a metadata field's key")
    if key not in TRANSFORM_KEYS:
        TRANSFORM_KEYS.append(key)
    return key


def _from_fields(values: Mapping[str, Any]) -> ModelMetadata:
    heads = values.get(CONFIG_KEYS["kept_heads"])
    length = values.get(CONFIG_KEYS["max_length"])
    return ModelMetadata(
        kept_heads=HeadSet.from_dict(heads) if heads else None,
        base_fingerprint=values.get(CONFIG_KEYS["base_fingerprint"]),
        calibration=values.get(CONFIG_KEYS["calibration"]),
        training=values.get(CONFIG_KEYS["training"]),
        max_length=None if length is None else int(length),
        member_transforms={k: values[k] for k in TRANSFORM_KEYS if values.get(k) is not None},
    )


def read_metadata(source: Any) -> ModelMetadata:
    """The record on a model, on its configuration, or in a configuration's dictionary (a model
    without a configuration has none)."""
    if isinstance(source, Mapping):
        return _from_fields(source)
    config = getattr(source, "config", source)
    keys = [*CONFIG_KEYS.values(), *TRANSFORM_KEYS]
    record = _from_fields({k: getattr(config, k) for k in keys if hasattr(config, k)})
    statistics = getattr(source, STATISTICS_ATTRIBUTE, None) if config is not source else None
    return record if statistics is None else replace(record, statistics=statistics)


def write_metadata(target: Any, **changes: Any) -> None:
    """Set the named `ModelMetadata` fields on a model's (or a configuration's) configuration;
    None removes a field. ``member_transforms`` sets the transforms it names; ``statistics`` is
    set on the model itself (TypeError for a configuration, which cannot hold tensors)."""
    config = getattr(target, "config", target)
    known = {f.name for f in fields(ModelMetadata)}
    unknown = set(changes) - known
    if unknown:
        raise TypeError(f"no metadata field {sorted(unknown)}; the fields are {sorted(known)}")
    for name, value in changes.items():
        if name == "statistics":
            if config is target and value is not None:
                raise TypeError("statistics are held by a model, not by its configuration")
            if value is not None or getattr(target, STATISTICS_ATTRIBUTE, None) is not None:
                setattr(target, STATISTICS_ATTRIBUTE, value)
            continue
        if name == "member_transforms":
            for key, record in value.items():
                if key not in TRANSFORM_KEYS:
                    raise TypeError(f"{key!r} is no registered member transform")
                _set(config, key, record)
            continue
        _set(config, CONFIG_KEYS[name], value.to_dict() if isinstance(value, HeadSet) else value)


def _set(config: Any, key: str, value: Any) -> None:
    if value is not None:
        setattr(config, key, value)
    elif key in vars(config):
        delattr(config, key)


def split_metadata(values: Mapping[str, Any]) -> tuple[ModelMetadata, dict[str, Any]]:
    """A saved configuration's dictionary as its record and the rest (Hugging Face's fields)."""
    record = _from_fields(values)
    ours = {*CONFIG_KEYS.values(), *TRANSFORM_KEYS}
    return record, {k: v for k, v in values.items() if k not in ours}


def read_head_sets(path: str | os.PathLike) -> list[HeadSet]:
    """The head sets a JSON file holds: one head set ``{layer: [heads]}`` or a non-empty list of
    them. Raises `HeadSetError`, naming the file, for anything else."""
    data = read_json(path, "head-set file")
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(item, dict) for item in items):
        raise HeadSetError(f"{path}: a head set {{layer: [heads]}} or a non-empty list of them is due")
    try:
        return [HeadSet.from_dict(item) for item in items]
    except (HeadSetError, TypeError, ValueError) as exc:
        raise HeadSetError(f"{path}: {exc}") from None
