"""Feature statistics saved with a model: ``ood_statistics.safetensors`` beside its weights.

A model's calibration (its metadata's, `saving.metadata`) names the statistics it was fit with by
their digest (its flag's ``statistics_sha256``: `statistics_digest`); the statistics themselves are
held by the model (`ModelMetadata.statistics`) and written by every saver before the file that marks the save
complete, so the folder's checksums cover them. Reading checks them against the digest the
calibration records: statistics edited, swapped or taken from another model are refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from ..errors import InputError
from ..saving.metadata import read_metadata, write_metadata
from .detectors import STATISTICS_NAME, FeatureStatistics

__all__ = ["read_statistics", "recorded_digest", "statistics_digest", "write_statistics"]


def statistics_digest(calibration: object) -> str:
    """The digest of the statistics a saved calibration record names ("" for none): its flag's
    (`calibration.Flag`), or the flat record's field where an earlier version saved it."""
    if not isinstance(calibration, dict):
        return ""
    flag = calibration.get("flag", calibration)
    return str(flag.get("statistics_sha256") or "") if isinstance(flag, dict) else ""


def recorded_digest(model: nn.Module) -> str:
    """The digest of the statistics ``model``'s calibration was fit with ("" for none)."""
    return statistics_digest(read_metadata(model).calibration)


def write_statistics(model: nn.Module, folder: str | os.PathLike) -> Path | None:
    """Write the statistics ``model`` holds into ``folder`` (nothing where it holds none)."""
    statistics = read_metadata(model).statistics
    if statistics is None or not recorded_digest(model):
        return None
    return statistics.save(Path(folder) / STATISTICS_NAME)


def read_statistics(
    model: nn.Module, folder: str | os.PathLike, error: type[ValueError] = InputError
) -> None:
    """Give ``model`` the statistics its calibration names, read from ``folder`` and checked
    against the recorded digest; ``error`` where they are missing or are not those."""
    digest = recorded_digest(model)
    if not digest:
        return
    path = Path(folder) / STATISTICS_NAME
    if not path.is_file():
        raise error(f"{path} is missing: the model's calibration was fit with OOD feature statistics")
    try:
        statistics = FeatureStatistics.load(path, digest)
    except ValueError as exc:
        raise error(str(exc)) from None
    write_metadata(model, statistics=statistics)
