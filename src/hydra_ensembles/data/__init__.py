"""Datasets that work offline, and deterministic splits."""

from .._moved import moved_to
from .images import ImageDataset, load_image_folder, load_npz
from .registry import (
    DATA_SOURCES,
    align_padding,
    check_max_length,
    load_spec,
    model_batches,
    register_data_source,
    to_batches,
)
from .splits import split_indices, split_of, stable_sample, stable_unit
from .text import MissingDataError, TextDataset, data_dir, load_text_table

MOVED_TO_EXPERIMENTS = (
    "BBC_ID_TOPICS",
    "BBC_NEAR_TOPIC",
    "bbc_news_splits",
    "load_bbc_news",
    "load_drug_reviews",
    "load_elpv",
    "load_fashion_mnist",
    "load_fortunes",
    "load_mnist",
    "load_spam_assassin",
    "load_texture_crops",
)
"""The paper's data sets, deprecated here: they live with the applications
(`hydra_experiments.datasets`), which register them as named data sources."""

__all__ = [
    "DATA_SOURCES",
    "ImageDataset",
    "MissingDataError",
    "TextDataset",
    "align_padding",
    "check_max_length",
    "data_dir",
    "load_image_folder",
    "load_npz",
    "load_spec",
    "load_text_table",
    "model_batches",
    "register_data_source",
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
    if name in MOVED_TO_EXPERIMENTS:
        return moved_to(__name__, "hydra_experiments.datasets")(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
