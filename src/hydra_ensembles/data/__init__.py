"""Datasets that work offline, and deterministic splits."""

from .images import (
    ImageDataset,
    load_elpv,
    load_fashion_mnist,
    load_image_folder,
    load_mnist,
    load_npz,
    load_texture_crops,
)
from .registry import BUILTIN, align_padding, check_max_length, load_spec, model_batches, to_batches
from .splits import split_indices, split_of, stable_sample, stable_unit
from .text import (
    BBC_ID_TOPICS,
    BBC_NEAR_TOPIC,
    MissingDataError,
    TextDataset,
    bbc_news_splits,
    data_dir,
    load_bbc_news,
    load_drug_reviews,
    load_fortunes,
    load_spam_assassin,
    load_text_table,
)

__all__ = [
    "BBC_ID_TOPICS",
    "BBC_NEAR_TOPIC",
    "BUILTIN",
    "ImageDataset",
    "MissingDataError",
    "TextDataset",
    "align_padding",
    "bbc_news_splits",
    "check_max_length",
    "data_dir",
    "load_bbc_news",
    "load_drug_reviews",
    "load_elpv",
    "load_fashion_mnist",
    "load_fortunes",
    "load_image_folder",
    "load_mnist",
    "load_npz",
    "load_spam_assassin",
    "load_spec",
    "load_text_table",
    "load_texture_crops",
    "model_batches",
    "split_indices",
    "split_of",
    "stable_sample",
    "stable_unit",
    "to_batches",
]


def __getattr__(name: str):
    # the text and image batch makers behind `to_batches`, public before it was the one entry point
    if name in ("batches", "image_batches"):
        import warnings

        from . import images, text

        warnings.warn(
            f"hydra_ensembles.data.{name} is deprecated; use hydra_ensembles.data.to_batches",
            DeprecationWarning,
            stacklevel=2,
        )
        return text.batches if name == "batches" else images.image_batches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
