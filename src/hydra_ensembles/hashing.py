"""SHA-256 digests: the one home of "is this the same model, data, configuration or file".

Saved files record some of them (a member's base `fingerprint`, a calibration's model digest,
a config's ``config_sha256``, a checkpoint's run key), so their layouts are part of the saved
formats: change one and older files stop matching.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import weakref
from collections.abc import Iterable
from dataclasses import is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads on first use: the file and JSON digests do not need it
    import torch
    from torch import nn


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def text_digest(text: str) -> str:
    """SHA-256 of ``text`` as UTF-8."""
    return hashlib.sha256(text.encode()).hexdigest()


def json_digest(value: Any) -> str:
    """SHA-256 of ``value``'s canonical JSON (keys sorted; values JSON cannot hold as ``str``)."""
    return text_digest(json.dumps(value, sort_keys=True, default=str))


def config_digest(config: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of every field but ``config_sha256`` itself: saved configs
    carry it, so an edited config is refused on load."""
    body = {k: v for k, v in config.items() if k != "config_sha256"}
    return text_digest(json.dumps(body, sort_keys=True))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    import torch

    tensor = tensor.detach().cpu().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def update_with_tensor(digest: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed a tensor's name, dtype, shape and bytes to a hashlib ``digest``."""
    digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
    digest.update(_tensor_bytes(tensor))


def batches_digest(batches: Iterable[dict[str, Any]], digest: Any = None) -> str:
    """SHA-256 of a list of batches (dicts): every tensor's name, dtype, shape and bytes, and
    every other value's ``repr``, in order. Equal digests mean the same data. With ``digest``,
    feeds that hashlib object (to hash several things together) and returns its hex digest."""
    import torch

    digest = digest if digest is not None else hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            value = batch[name]
            if isinstance(value, torch.Tensor):
                update_with_tensor(digest, name, value)
            else:
                digest.update(f"{name}={value!r}".encode())
    return digest.hexdigest()


_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (signature, digest)


def state_signature(state: dict[str, torch.Tensor]) -> tuple | None:
    """Storage address and in-place version counter of every tensor: any write changes it."""
    try:
        return tuple((name, t.data_ptr(), t._version, tuple(t.shape), t.dtype) for name, t in state.items())
    except RuntimeError:  # inference tensors have no version counter: do not cache
        return None


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (names, shapes, dtypes, bytes): what a pruned
    member records of its base, and a saved calibration of its model.

    Cached per model object until any tensor is written in place or replaced (tracked by
    storage address and version counter), so repeated pruning of one base hashes it once.
    """
    state = model.state_dict()
    signature = state_signature(state)
    cached = _FINGERPRINTS.get(model)
    if signature is not None and cached is not None and cached[0] == signature:
        return cached[1]
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        # name:shape:dtype, the layout saved members and calibrations were written with
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(_tensor_bytes(tensor))
    value = digest.hexdigest()
    if signature is not None:
        _FINGERPRINTS[model] = (signature, value)
    return value


def module_fingerprint(model: nn.Module) -> str:
    """SHA-256 of a module's type, structure (``repr``), every submodule's plain settings (numbers,
    strings, tuples, dataclasses such as a zero-shot config) and every parameter and buffer (names,
    dtypes, shapes and bytes): equal fingerprints mean the same computation (what a cached
    prediction is keyed by; `fingerprint` covers the weights only)."""
    digest = hashlib.sha256(f"{type(model).__qualname__}\n{model!r}".encode())
    for path, module in model.named_modules(remove_duplicate=False):
        for name, value in sorted(vars(module).items()):
            if not name.startswith("_") and name != "training" and _is_setting(value):
                digest.update(re.sub(r"0x[0-9a-f]+", "", f"{path}.{name}={value!r}").encode())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        update_with_tensor(digest, name, tensor)
    return digest.hexdigest()


def _is_setting(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))) or is_dataclass(value):
        return True
    return isinstance(value, (tuple, list)) and all(_is_setting(v) for v in value)
