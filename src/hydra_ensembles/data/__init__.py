"""Datasets that work offline, and deterministic splits."""

from .splits import split_indices, split_of, stable_sample, stable_unit
from .text import MissingDataError, TextDataset, batches, load_bbc_news

__all__ = [
    "MissingDataError",
    "TextDataset",
    "batches",
    "load_bbc_news",
    "split_indices",
    "split_of",
    "stable_sample",
    "stable_unit",
]
