"""Datasets that work offline, and deterministic splits."""

from .images import (
    ImageDataset,
    image_batches,
    load_elpv,
    load_fashion_mnist,
    load_image_folder,
    load_mnist,
    load_npz,
    load_texture_crops,
)
from .registry import BUILTIN, load_spec, to_batches
from .splits import split_indices, split_of, stable_sample, stable_unit
from .text import (
    BBC_ID_TOPICS,
    BBC_NEAR_TOPIC,
    MissingDataError,
    TextDataset,
    batches,
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
    "batches",
    "bbc_news_splits",
    "data_dir",
    "image_batches",
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
    "split_indices",
    "split_of",
    "stable_sample",
    "stable_unit",
    "to_batches",
]
