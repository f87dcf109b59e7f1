"""Everything the library writes and reads back, in one place.

- `files`: atomic writes (a file or a folder appears whole or not at all, never over an input),
  file sets with a manifest (training checkpoints), JSON reading, writable-folder checks.
- `formats`: the one saved-model reader and writer (safetensors weights plus a checksummed JSON
  config, written last) and the registry of saved formats (`SavedFormat`: a fused Hydra model,
  a member, an ensemble of members, a zero-shot Hydra model register themselves), the checksums
  of folders ``finetune`` writes.
- `metadata`: `ModelMetadata`, what the library records about a model beside Hugging Face's
  configuration (the heads surgery kept, the base model's fingerprint, the calibration, the
  training record, the token length, the member transforms of the baselines).
Loading whatever a folder holds (``load_saved``, ``load_any``) must know every model kind, so it
sits above the model packages, in `hydra_ensembles.loading`; this package imports none of them.

Nothing is ever unpickled and no code is loaded from files. The names here load with their
modules on first use, so the file helpers cost no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._imports import lazy_exports

if TYPE_CHECKING:
    from .files import OutputError, atomic_dir, atomic_write, atomic_write_json, read_json
    from .formats import SavedFormat, read_saved, register_saved_format, saved_format, write_saved
    from .metadata import ModelMetadata, read_metadata, write_metadata

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".files": ("OutputError", "atomic_dir", "atomic_write", "atomic_write_json", "read_json"),
        ".formats": ("SavedFormat", "read_saved", "register_saved_format", "saved_format", "write_saved"),
        ".metadata": ("ModelMetadata", "read_metadata", "write_metadata"),
    },
)
