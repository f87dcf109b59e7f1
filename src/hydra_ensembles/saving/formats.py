"""One reader and writer for saved models (members and fused Hydra models).

A saved model is a folder with ``model.safetensors`` and a JSON config that names its format and
version, records the weights' SHA-256 and its own digest, and is written last (its presence
means the save finished). Reading checks all of it before any tensor is built, so a truncated,
tampered or half-written folder is refused with a clear error. No code is loaded from files and
nothing is unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import InputError
from ..hashing import config_digest, sha256_file
from .files import atomic_write, atomic_write_json, read_json

WEIGHTS_NAME = "model.safetensors"
HF_CONFIG_NAME = "config.json"  # Hugging Face's configuration, which routes the Auto classes


def write_saved(
    path: str | os.PathLike, config_name: str, config: dict[str, Any], state: dict[str, torch.Tensor]
) -> Path:
    """Write ``state`` as safetensors, then ``config`` as ``config_name`` with the checksums of the
    weights, of every other file already in the folder (a tokenizer or image processor saved
    there first: `read_saved` refuses one edited later) and of itself."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    weights = atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp)))
    config = {
        **config,
        "weights_sha256": sha256_file(weights),
        "files_sha256": companion_digests(path, config_name),
    }
    config["config_sha256"] = config_digest(config)
    atomic_write_json(path / config_name, config)  # written last: its presence means complete
    return path


def companion_digests(path: Path, config_name: str) -> dict[str, str]:
    """SHA-256 of every file in ``path`` besides the weights and the config (hidden files and
    leftovers of interrupted writes excluded; so is the Hugging Face ``config.json``, which only
    routes the Auto classes to the library's loader, is written after the model and is never
    read by it)."""
    return file_digests(path, exclude=(WEIGHTS_NAME, config_name, HF_CONFIG_NAME))


def file_digests(folder: Path, exclude: Collection[str] = ()) -> dict[str, str]:
    """SHA-256 of every file in ``folder`` by name, hidden files and ``exclude`` left out."""
    return {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in exclude and not p.name.startswith(".")
    }


def read_saved(
    path: str | os.PathLike,
    config_name: str,
    fmt: str,
    versions: Collection[int],
    required: Collection[str],
    error: type[ValueError],
    what: str,
    device: str | torch.device | None = None,
    unsigned_versions: Collection[int] = (),
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checked config and weights of a folder written by `write_saved`; ``error`` (naming the
    file and what is wrong) where anything is missing, unknown or does not match its checksum.
    ``unsigned_versions``: old format versions written before configs carried their digest."""
    path = Path(path)
    file = path / config_name
    if not file.is_file():
        raise error(f"{file} not found: not a saved {what} (or the save did not finish)")
    try:
        config = read_json(file, f"{what} config")
    except ValueError as exc:
        raise error(str(exc)) from None
    if not isinstance(config, dict) or config.get("format") != fmt:
        raise error(f"{file} is not a {fmt} file")
    if config.get("format_version", 1) not in versions:
        raise error(
            f"{file} has format version {config.get('format_version')}, this library reads {sorted(versions)}"
        )
    version = config.get("format_version", 1)
    signed = set() if version in unsigned_versions else {"config_sha256"}
    missing = {*required, *signed, "weights_sha256"} - set(config)
    if missing:
        raise error(f"{file} lacks {sorted(missing)}")
    if "config_sha256" in config and config_digest(config) != config["config_sha256"]:
        raise error(f"{file} does not match its own checksum: it was modified after saving")
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise error(f"{weights} is missing")
    if sha256_file(weights) != config["weights_sha256"]:
        raise error(
            f"{weights} does not match the checksum in {config_name}: the file is truncated, "
            "corrupted or was modified after saving"
        )
    check_companions(path, config.get("files_sha256", {}), config_name, error)
    try:
        state = load_file(str(weights), device=str(device) if device else "cpu")
    except (SafetensorError, OSError) as exc:
        raise error(f"cannot read {weights}: {exc}") from exc
    check_finite(state.items(), str(weights), error)
    return config, state


def check_companions(
    path: Path, digests: dict[str, str], config_name: str, error: type[ValueError] = InputError
) -> None:
    """``error`` where a file `companion_digests` recorded (a tokenizer, feature statistics) is
    missing or was modified since, or where the record names anything but plain names of files
    in ``path`` (``../x``, ``/etc/x``, ``./a``, ``a/b``: refused before anything is hashed)."""
    if not isinstance(digests, dict):
        raise error(f"{path / config_name} records its files' checksums as a {type(digests).__name__}")
    for name, digest in digests.items():
        if not _plain_name(name) or not isinstance(digest, str):
            raise error(
                f"{path / config_name} names {str(name)[:80]!r}, which is not the plain name of a file "
                "in the folder: it was not written by this library"
            )
    for name, digest in digests.items():
        companion = path / name
        if not companion.is_file() or sha256_file(companion) != digest:
            state_of = "is missing" if not companion.is_file() else "was modified after saving"
            raise error(f"{companion} {state_of} (its checksum is in {config_name})")


FOLDER_CHECKSUMS = "checksums.json"
"""The SHA-256 of every file of a Hugging Face model folder the library writes (``finetune``'s
output): weights, ``config.json`` (classes, calibration), tokenizer or image processor, feature
statistics."""

CHECKSUMS_FORMAT = "hydra-folder-checksums"

_LOADER_SUFFIXES = (".json", ".txt", ".model", ".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
"""Suffixes of the files Hugging Face loaders read from a model folder: one added to a checksummed
folder (a ``tokenizer.json`` beside the recorded ``vocab.txt``) would change what is loaded."""

_CHECKED: set[tuple] = set()
"""Folder states (every file's name, size and modification time) already checked."""


def write_folder_checksums(folder: str | os.PathLike) -> Path:
    """Record the SHA-256 of every file in ``folder`` (hidden files excepted) in
    ``checksums.json``, written last; `check_folder_checksums` refuses the folder once any
    recorded file is changed or removed, or a file a loader reads is added."""
    folder = Path(folder)
    digests = file_digests(folder, exclude=(FOLDER_CHECKSUMS,))
    record: dict[str, Any] = {"format": CHECKSUMS_FORMAT, "format_version": 1, "files_sha256": digests}
    record["config_sha256"] = config_digest(record)
    return atomic_write_json(folder / FOLDER_CHECKSUMS, record)


def _plain_name(name: object) -> bool:
    """Whether ``name`` is the plain name of an entry of a folder (no separator, not . or ..)."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and os.sep not in name
        and "\0" not in name
        and (os.altsep is None or os.altsep not in name)
    )


def check_folder_checksums(folder: str | os.PathLike, error: type[ValueError] = InputError) -> None:
    """``error`` in one line where a folder with ``checksums.json`` no longer holds the files it
    recorded (changed, removed, or a loader's file added); nothing for a folder without one (a
    model the library did not write). Checked once per state of the record."""
    file = Path(folder) / FOLDER_CHECKSUMS
    if not file.is_file():
        return
    files = sorted(p for p in Path(folder).iterdir() if p.is_file())
    key = (str(file.resolve()), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key in _CHECKED:
        return
    try:
        record = read_json(file, "checksum record")
    except ValueError as exc:
        raise error(str(exc)) from None
    if not isinstance(record, dict) or record.get("format") != CHECKSUMS_FORMAT:
        raise error(f"{file} is not a checksum record of this library")
    if record.get("format_version") != 1 or config_digest(record) != record.get("config_sha256"):
        raise error(f"{file} does not match its own checksum: it was modified after saving")
    digests = record.get("files_sha256")
    if not isinstance(digests, dict):
        raise error(f"{file} lacks files_sha256")
    check_companions(Path(folder), digests, FOLDER_CHECKSUMS, error)
    added = [
        p.name
        for p in files
        if p.suffix in _LOADER_SUFFIXES and p.name not in {*digests, FOLDER_CHECKSUMS} and p.name[0] != "."
    ]
    if added:
        raise error(
            f"{Path(folder) / added[0]} was added after saving (not in {FOLDER_CHECKSUMS}): a loader "
            "would read it instead of the files the model was saved with"
        )
    _CHECKED.add(key)


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding NaN or Inf, or None."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def check_finite(
    tensors: Iterable[tuple[str, torch.Tensor]], source: str, error: type[ValueError] = InputError
) -> None:
    """Refuse weights holding NaN or Inf (a diverged training, a damaged file): every prediction
    and ranking computed from them would be meaningless. ``error`` names ``source`` and the first
    such tensor."""
    name = first_non_finite(tensors)
    if name is not None:
        raise error(
            f"{source}: the weights {name} hold NaN or Inf (a diverged training or a damaged file); "
            "they cannot be used"
        )


@dataclass(frozen=True)
class SavedFormat:
    """One kind of model the library saves: the class it saves (``model_class``), how
    (``save(model, folder)``), the file that marks its folders (``config_name``) and how they load
    (``load(folder)``). A new format is one module that defines them and calls
    `register_saved_format`; `save_model`, `loading.load_any`, the served Auto classes
    (``HydraConfig.saved_format``) and the ONNX export then take it, with no change elsewhere."""

    kind: str
    """Its name, as `loading.load_saved` returns it (``"fused"``, ``"member"``, ...)."""
    config_name: str
    load: Callable[[Path], Any]
    classifier: bool = True
    """A classifier: loaded by `loading.load_saved` and served (pipelines, Auto classes, ONNX);
    False: by `loading.load_any` only."""
    preprocessor_folder: Callable[[Path], Path] | None = None
    """Where its tokenizer or image processor is saved when the folder holds none of its own."""
    model_class: type | None = None
    """The class of the models it saves; None: any classifier no other format claims (a member)."""
    save: Callable[[Any, Path], Path] | None = None
    """Writes a model into a folder (atomically, marker file last) and returns the folder."""


SAVED_FORMATS: dict[str, SavedFormat] = {}
"""Every registered format by its kind, in registration order."""


def register_saved_format(saved: SavedFormat) -> SavedFormat:
    """Add ``saved`` to `SAVED_FORMATS`; refuses a kind or a marker file another format has."""
    for other in SAVED_FORMATS.values():
        if other.kind != saved.kind and other.config_name == saved.config_name:
            raise ValueError(f"{saved.config_name} marks {other.kind} folders already")
    SAVED_FORMATS[saved.kind] = saved
    return saved


def format_of(model: Any) -> SavedFormat:
    """The format that saves ``model``: the one registered for its class (or a base class), else
    the one for any other classifier (`SavedFormat.model_class` None)."""
    claimed = [f for f in SAVED_FORMATS.values() if f.model_class is not None and f.save is not None]
    found = next((f for f in claimed if isinstance(model, f.model_class)), None)
    found = found or next((f for f in SAVED_FORMATS.values() if f.model_class is None and f.save), None)
    if found is None:
        raise InputError(f"no saved format saves a {type(model).__name__}")
    return found


def save_model(model: Any, folder: str | os.PathLike) -> Path:
    """Save ``model`` in its format (`format_of`): the one way the library saves a model."""
    return format_of(model).save(model, Path(folder))


def classifier_kinds() -> list[str]:
    """The kinds of the registered classifier formats (what ``HydraConfig.saved_format`` names)."""
    return [kind for kind, f in SAVED_FORMATS.items() if f.classifier]


def saved_format(folder: str | os.PathLike) -> SavedFormat | None:
    """The format of the folder ``folder`` (the first whose marker file it holds), or None."""
    return next((f for f in SAVED_FORMATS.values() if (Path(folder) / f.config_name).is_file()), None)
