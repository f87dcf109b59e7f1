"""Saving and loading fused models: ``hydra_config.json`` + ``model.safetensors``.

Loading rebuilds the architecture from the JSON description (a transformers class chosen from the
supported families, its config, the members' head sets and the grouped-module layout) and fills
it from safetensors. No code is loaded from files and nothing is unpickled. The JSON records the
weights' SHA-256, so a truncated or tampered weights file is refused with a clear error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .._version import __version__
from ..adapters import get_adapter
from ..heads import HeadSet
from ..io import atomic_write, atomic_write_json, config_digest, sha256_file
from ..layers import FusedMultiHeadAttention, GroupedLayerNorm, GroupedLinear, PerMemberModule
from ..models import build_model
from .model import FusionPolicy, HydraModel

CONFIG_NAME = "hydra_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "hydra-ensembles/fused"
FORMAT_VERSION = 1


class HydraLoadError(ValueError):
    """A saved Hydra model is missing, incomplete, tampered with, or from an unknown format."""


def save_hydra(hydra: HydraModel, path: str | os.PathLike) -> Path:
    """Write the fused model to the directory ``path`` (created if needed)."""
    path = Path(path)
    state = {k: v.detach().contiguous() for k, v in hydra.model.state_dict().items()}
    dtypes = {str(p.dtype).removeprefix("torch.") for p in hydra.model.parameters()}
    weights = atomic_write(path / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp)))
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "model_class": type(hydra.model).__name__,
        "base_config": hydra.model.config.to_dict(),
        "attn_implementation": getattr(hydra.model.config, "_attn_implementation", None),
        "dtype": dtypes.pop() if len(dtypes) == 1 else None,
        "head_sets": [hs.to_dict() for hs in hydra.head_sets],
        "policy": hydra.policy.to_dict(),
        "layout": list(hydra.layout),
        "trunk_layers": hydra.trunk_layers,
        "weights_sha256": sha256_file(weights),
    }
    config["config_sha256"] = config_digest(config)
    atomic_write_json(path / CONFIG_NAME, config)  # written last: its presence means complete
    return path


def load_hydra(path: str | os.PathLike, device: str | torch.device | None = None) -> HydraModel:
    """Load a model written by `HydraModel.save_pretrained`; outputs are bitwise identical."""
    path = Path(path)
    config = _read_config(path)
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise HydraLoadError(f"{weights} is missing")
    if sha256_file(weights) != config["weights_sha256"]:
        raise HydraLoadError(
            f"{weights} does not match the checksum in {CONFIG_NAME}: the file is truncated, "
            "corrupted or was modified after saving"
        )
    try:
        state = load_file(str(weights), device=str(device) if device else "cpu")
    except (SafetensorError, OSError) as exc:
        raise HydraLoadError(f"cannot read {weights}: {exc}") from exc

    model = _build_base(config)
    adapter = get_adapter(model)
    head_sets = [HeadSet.from_dict(hs) for hs in config["head_sets"]]
    original = adapter.original_heads_per_layer(model)
    resolved = [hs.resolve(original) for hs in head_sets]
    m = len(head_sets)
    dropout = adapter.attention_dropout(model)
    trunk = int(config.get("trunk_layers", 0))
    for layer in range(len(original)):
        block = adapter.attention_block(model, layer)
        counts = [len(r[layer]) for r in resolved]
        fused = FusedMultiHeadAttention(
            block.hidden_size, block.head_dim, counts[:1] if layer < trunk else counts, dropout
        )
        adapter.install_fused_attention(model, layer, fused)
    for entry in config["layout"]:
        model.set_submodule(entry["path"], _empty_grouped(model, entry, m))
    if config.get("dtype"):
        model.to(getattr(torch, config["dtype"]))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise HydraLoadError(f"weights in {weights} do not fit {CONFIG_NAME}: {exc}") from exc
    model.to(device or "cpu").eval()
    policy = FusionPolicy(**config["policy"])
    return HydraModel(model, adapter, head_sets, policy, config["layout"], trunk_layers=trunk)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise HydraLoadError(f"{file} not found: not a saved Hydra model (or the save did not finish)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HydraLoadError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise HydraLoadError(f"{file} is not a {FORMAT} file")
    if config.get("format_version") != FORMAT_VERSION:
        raise HydraLoadError(
            f"{file} has format version {config.get('format_version')}, this library reads {FORMAT_VERSION}"
        )
    required = {
        "model_class",
        "base_config",
        "head_sets",
        "policy",
        "layout",
        "weights_sha256",
        "config_sha256",
    }
    missing = required - set(config)
    if missing:
        raise HydraLoadError(f"{file} lacks {sorted(missing)}")
    if config_digest(config) != config["config_sha256"]:
        raise HydraLoadError(f"{file} does not match its own checksum: it was modified after saving")
    return config


def _build_base(config: dict[str, Any]) -> nn.Module:
    try:
        return build_model(config["model_class"], config["base_config"], config.get("attn_implementation"))
    except ValueError as exc:
        raise HydraLoadError(str(exc)) from exc


def _empty_grouped(model: nn.Module, entry: dict[str, Any], num_members: int) -> nn.Module:
    module = model.get_submodule(entry["path"])
    kind = entry["kind"]
    if kind == "grouped_linear":
        return GroupedLinear(num_members, module.in_features, module.out_features, module.bias is not None)
    if kind == "grouped_layer_norm":
        return GroupedLayerNorm(
            num_members, module.normalized_shape[0], module.eps, bias=module.bias is not None
        )
    if kind == "per_member":
        return PerMemberModule.empty_like(module, num_members)
    raise HydraLoadError(f"unknown layout kind {kind!r} at {entry['path']!r}")
