"""Saving and loading single (pruned, possibly fine-tuned) members: safetensors + JSON."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..io import atomic_write, atomic_write_json, config_digest, read_json, sha256_file
from ..models import build_model
from ..surgery import FINGERPRINT_KEY, KEPT_HEADS_KEY, kept_heads, prune
from .batch_ensemble import BATCH_ENSEMBLE_KEY, batch_ensemble

CONFIG_NAME = "member_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "hydra-ensembles/member"
FORMAT_VERSION = 2


class MemberLoadError(ValueError):
    """A directory is not a complete, unmodified saved member."""


def save_member(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write a (pruned, or BatchEnsemble) model: its config with the kept heads (and members), and
    its weights."""
    path = Path(path)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights = atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp)))
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_class": type(model).__name__,
        "config": model.config.to_dict(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "weights_sha256": sha256_file(weights),
    }
    meta["config_sha256"] = config_digest(meta)
    atomic_write_json(path / CONFIG_NAME, meta)  # written last: its presence means complete
    return path


def load_member(path: str | os.PathLike) -> nn.Module:
    """Rebuild the pruned architecture from JSON and load its weights (no pickle, no code)."""
    path = Path(path)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise MemberLoadError(f"{file} not found: not a saved member (or the save did not finish)")
    try:
        meta = read_json(file, "member config")
    except ValueError as exc:
        raise MemberLoadError(str(exc)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise MemberLoadError(f"{file} is not a {FORMAT} file")
    if meta.get("format_version", 1) not in (1, FORMAT_VERSION) or not {"model_class", "config"} <= set(meta):
        raise MemberLoadError(f"{file} has an unknown format version or lacks fields")
    signed = "config_sha256" in meta or meta.get("format_version") == FORMAT_VERSION
    if signed and config_digest(meta) != meta.get("config_sha256"):
        raise MemberLoadError(f"{file} does not match its own checksum: it was modified after saving")
    weights = path / WEIGHTS_NAME
    if not weights.is_file() or sha256_file(weights) != meta.get("weights_sha256"):
        raise MemberLoadError(f"{weights} is missing or does not match its checksum")
    try:
        return _rebuild(path, meta)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise MemberLoadError(f"{path} cannot be rebuilt: {exc}") from exc


def _rebuild(path: Path, meta: dict) -> nn.Module:
    config = dict(meta["config"])
    heads = config.pop(KEPT_HEADS_KEY, None)
    base_print = config.pop(FINGERPRINT_KEY, None)
    members = config.pop(BATCH_ENSEMBLE_KEY, None)
    model = build_model(meta["model_class"], config, meta.get("attn_implementation"))
    if heads is not None:
        from ..heads import HeadSet

        model = prune(model, HeadSet.from_dict(heads))
        setattr(model.config, FINGERPRINT_KEY, base_print)
    if members:  # the architecture of a BatchEnsemble; its weights come from the file
        model = batch_ensemble(model, int(members), init_std=0.0)
    state = load_file(str(path / WEIGHTS_NAME))
    dtype = next(iter(state.values())).dtype
    model.to(dtype).load_state_dict(state, strict=True)
    assert kept_heads(model) is not None
    return model.eval().to(torch.device("cpu"))
