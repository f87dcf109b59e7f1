"""What a part of a calibration was fit on: a data set's name and the SHA-256 of what was read
(`DataRecord`). A calibration records one for its ID validation data, one for the training data
its feature statistics were fit on and one for the OOD validation data its flag score was chosen
on; `hydra-ens eval` and the sweep compare them to refuse test data a calibration was fit on."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..hashing import batches_digest

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DataRecord:
    """A data set's name (a path, a source name; may be empty) and the SHA-256 of what was read
    of it (empty where nothing was read)."""

    name: str = ""
    sha256: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not isinstance(self.sha256, str):
            raise InputError(f"a data record is a name and a SHA-256, both strings: got {self!r}")
        if self.sha256 and not _SHA256.fullmatch(self.sha256):
            raise InputError(f"a data record's SHA-256 is 64 lowercase hex digits, got {self.sha256!r}")

    @classmethod
    def of_batches(cls, name: str, batches: Iterable[dict[str, Any]]) -> DataRecord:
        """The record of the batches read from ``name`` (`hashing.batches_digest`)."""
        return cls(name or "", batches_digest(batches))


NO_DATA = DataRecord()
"""The record of data not given (nothing read)."""


@dataclass(frozen=True)
class Provenance:
    """What a calibration's parts were fit on: its ID validation data, the training data of its
    feature statistics and the OOD validation data its flag score was chosen on."""

    validation: DataRecord
    statistics: DataRecord = NO_DATA
    ood: DataRecord = NO_DATA

    def to_dict(self) -> dict[str, dict[str, str]]:
        """The JSON record: each data record's name and SHA-256."""
        return {part: dataclasses.asdict(getattr(self, part)) for part in _PARTS}

    @classmethod
    def from_dict(cls, saved: Any) -> Provenance:
        """A provenance from its saved record (`to_dict`); InputError naming what is wrong."""
        if not isinstance(saved, dict) or set(saved) != set(_PARTS):
            raise InputError(
                f"a saved calibration's provenance names the data of {list(_PARTS)}, got {saved!r:.80}"
            )
        records = []
        for part in _PARTS:
            if not isinstance(saved[part], dict) or set(saved[part]) != {"name", "sha256"}:
                raise InputError(
                    f"a saved calibration's {part} record is a name and a SHA-256, got {saved[part]!r:.80}"
                )
            records.append(DataRecord(**saved[part]))
        return cls(*records)

    @property
    def digests(self) -> tuple[str, str, str]:
        """The three SHA-256s (empty where nothing was read), in that order."""
        return self.validation.sha256, self.statistics.sha256, self.ood.sha256


_PARTS = ("validation", "statistics", "ood")

NOTHING_READ = Provenance(NO_DATA)
"""The provenance of a calibration fit on predictions with no record of their data."""
