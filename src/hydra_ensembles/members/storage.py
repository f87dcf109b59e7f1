"""Saving and loading single (pruned, possibly fine-tuned) members: safetensors + JSON."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..baselines.registry import rebuild_transforms
from ..configuration import write_hf_config
from ..errors import InputError
from ..models import build_model, load_classifier
from ..ood.storage import read_statistics, write_statistics
from ..saving.formats import (
    HF_CONFIG_NAME,
    WEIGHTS_NAME,
    SavedFormat,
    read_saved,
    register_saved_format,
    write_folder_checksums,
    write_saved,
)
from ..saving.metadata import split_metadata, write_metadata
from ..surgery import prune

CONFIG_NAME = "member_config.json"
FORMAT = "hydra-ensembles/member"
FORMAT_VERSION = 2

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "AutoMember", "MemberLoadError", "load_member", "save_member"]


class MemberLoadError(InputError):
    """A directory is not a complete, unmodified saved member."""


def save_member(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write a (pruned, BatchEnsemble, head-ensemble, Packed-Ensemble or MIMO) model: its config
    with the kept heads (and members), and its weights; then the ``config.json`` that routes
    ``transformers``' Auto classes and ``pipeline`` to it."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_class": type(model).__name__,
        "config": model.config.to_dict(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    write_statistics(model, path)  # before the config, whose checksums then cover it
    saved = write_saved(path, CONFIG_NAME, meta, model.state_dict())
    write_hf_config(saved, model.config, "member")
    return saved


def load_member(path: str | os.PathLike) -> nn.Module:
    """Rebuild the pruned architecture from JSON and load its weights (no pickle, no code)."""
    meta, state = read_saved(
        path,
        CONFIG_NAME,
        FORMAT,
        versions=(1, FORMAT_VERSION),
        required=("model_class", "config"),
        error=MemberLoadError,
        what="member",
        unsigned_versions=(1,),
    )
    try:
        model = _rebuild(meta, state)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise MemberLoadError(f"{path} cannot be rebuilt: {exc}") from exc
    read_statistics(model, path, MemberLoadError)
    return model


class AutoMember:
    """Saved members the Hugging Face way, like ``AutoModel``: ``AutoMember.from_pretrained(path)``
    returns the rebuilt model (a transformers model with its pruned attention, BatchEnsemble,
    head ensemble, Packed-Ensemble or MIMO layers), never an ``AutoMember``.

    A member's own ``save_pretrained`` is Hugging Face's and writes a checkpoint that Hugging Face
    cannot rebuild pruned; save members with `save_member` (or ``AutoMember.save_pretrained``)."""

    def __init__(self) -> None:
        raise TypeError("AutoMember is not instantiated: use AutoMember.from_pretrained(path)")

    @staticmethod
    def from_pretrained(path: str | os.PathLike) -> nn.Module:
        """`load_member`: checked against its checksums, rebuilt from JSON (no pickle, no code)."""
        return load_member(path)

    @staticmethod
    def save_pretrained(model: nn.Module, path: str | os.PathLike) -> Path:
        """`save_member`: safetensors + checksummed JSON, written atomically."""
        return save_member(model, path)


def _rebuild(meta: dict, state: dict[str, torch.Tensor]) -> nn.Module:
    metadata, config = split_metadata(meta["config"])
    records = dict(metadata.member_transforms)  # the baselines' transforms
    model = build_model(meta["model_class"], config, meta.get("attn_implementation"))
    write_metadata(model, training=metadata.training, max_length=metadata.max_length)
    model = rebuild_transforms(model, records, before_pruning=True)
    if metadata.kept_heads is not None:
        model = prune(model, metadata.kept_heads)
        write_metadata(model, base_fingerprint=metadata.base_fingerprint)
    model = rebuild_transforms(model, records, before_pruning=False)  # weights from the file
    dtype = next(iter(state.values())).dtype
    model.to(dtype).load_state_dict(state, strict=True)
    write_metadata(model, calibration=metadata.calibration)  # bound to the weights just loaded
    return model.eval().to(torch.device("cpu"))


register_saved_format(SavedFormat("member", CONFIG_NAME, load_member, save=save_member))  # any classifier


def save_classifier(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model`` as a Hugging Face classifier folder (``hydra-ens finetune``'s output): its
    weights and configuration (``save_pretrained``, with the class names and the calibration),
    the feature statistics the calibration names, and the folder's checksums last (loaders refuse
    the folder once a file changes)."""
    folder = Path(path)
    model.save_pretrained(folder)
    write_statistics(model, folder)
    write_folder_checksums(folder)
    return folder


CLASSIFIER = SavedFormat(
    "classifier", HF_CONFIG_NAME, lambda folder: load_classifier(str(folder)), save=save_classifier
)
"""A Hugging Face classifier folder as the library writes it. Not registered: transformers reads
it as it is, and the library knows it by elimination (a folder with ``config.json`` that no
registered format's marker claims), so that registered formats keep their folders."""
