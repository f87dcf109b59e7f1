"""Load whatever a path holds: a saved Hydra or zero-shot Hydra model, a saved member, a saved
ensemble of members, or a Hugging Face classifier."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn
from transformers import AutoConfig

from . import fusion, members, zero_shot  # noqa: F401  (their saved formats register on import)
from .configuration import MODEL_TYPE
from .errors import InputError
from .hashing import json_digest
from .models import (
    VISION_MODEL_TYPES,
    load_classifier,
    load_image_processor,
    load_tokenizer,
    resolve_model_path,
)
from .saving.formats import SAVED_FORMATS, saved_format


def load_saved(path: str | os.PathLike) -> tuple[nn.Module, str]:
    """A classifier folder the library saved, with its format's kind: a fused Hydra model
    (``"fused"``), a member (``"member"``), an ensemble of members (``"ensemble"``, a
    `DeepEnsemble`) or any registered format (`saving.register_saved_format`); InputError
    for any other folder."""
    folder = Path(path)
    found = saved_format(folder)
    if found is None or not found.classifier:
        names = [f.config_name for f in SAVED_FORMATS.values() if f.classifier]
        listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
        raise InputError(
            f"{folder} holds no {listed}: not a classifier saved by hydra-ensembles "
            "(or the save did not finish)"
        )
    return found.load(folder), found.kind


def saved_preprocessor(path: str | os.PathLike) -> Any:
    """The tokenizer or image processor saved in a model's folder (for a saved ensemble without
    one of its own: its first member's), or None where there is none."""
    folder = Path(path)
    own = any((folder / name).is_file() for name in ("tokenizer_config.json", "preprocessor_config.json"))
    found = saved_format(folder)
    if not own and found is not None and found.preprocessor_folder is not None:
        folder = found.preprocessor_folder(folder)
    if (folder / "tokenizer_config.json").is_file():
        return load_tokenizer(str(folder))
    if (folder / "preprocessor_config.json").is_file():
        return load_image_processor(str(folder))
    return None


def preprocessing_signature(preprocessor: Any) -> str | None:
    """A digest of what ``preprocessor`` turns an input into (a tokenizer's whole definition:
    vocabulary, normalisation, special tokens, padding side; an image processor's settings):
    equal digests, equal model inputs. None for no preprocessor."""
    if preprocessor is None:
        return None
    backend = getattr(preprocessor, "backend_tokenizer", None)
    if backend is not None or hasattr(preprocessor, "get_vocab"):
        if backend is not None:  # its definition, without the padding/truncation of its last call
            definition: Any = json.loads(backend.to_str())
            definition = {k: v for k, v in definition.items() if k not in ("padding", "truncation")}
        else:
            definition = sorted(preprocessor.get_vocab().items())
        return json_digest(
            {
                "backend": definition,
                "special": {k: str(v) for k, v in preprocessor.special_tokens_map.items()},
                "padding_side": getattr(preprocessor, "padding_side", None),
                "inputs": list(getattr(preprocessor, "model_input_names", [])),
            }
        )
    settings = preprocessor.to_dict() if hasattr(preprocessor, "to_dict") else vars(preprocessor)
    return json_digest({"class": type(preprocessor).__name__, **settings})


def load_preprocessor(path: str) -> Any:
    """What a model's inputs are made with: the tokenizer or image processor saved with it
    (`saved_preprocessor`; ``build`` saves them beside members and the fused model), else a hub
    model's or embedded name's own, else None (a model saved without one)."""
    found = saved_preprocessor(path)
    if found is not None or saved_format(path) is not None:
        return found
    resolved = resolve_model_path(path)  # a changed checksummed folder is refused, not skipped
    try:
        config = AutoConfig.from_pretrained(resolved)
    except (OSError, ValueError):
        return None
    if config.model_type == MODEL_TYPE:  # a folder the library saved: its preprocessor is saved in it
        return None
    if config.model_type in VISION_MODEL_TYPES:
        return load_image_processor(path)
    return load_tokenizer(path)


def load_any(path: str, num_labels: int | None = None) -> nn.Module:
    """A folder in any saved format (a zero-shot Hydra, a Hydra model, a member, an ensemble of
    members, or a registered format), or a Hugging Face classifier (hub id or directory;
    ``num_labels=None`` keeps its saved head)."""
    found = saved_format(path)
    if found is not None:
        return found.load(Path(path))
    return load_classifier(path, num_labels=num_labels)
