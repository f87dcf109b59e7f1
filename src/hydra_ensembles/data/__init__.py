"""Datasets that work offline, and deterministic splits."""

from ..errors import MissingDataError
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
from .text import TextDataset, data_dir, load_text_table

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
