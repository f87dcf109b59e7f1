"""Offline text corpora (installed from packages, no download) and tokenised batches for sequence
classifiers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from .labels import align_labels, parse_labels


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


def data_dir() -> Path:
    """Where downloaded corpora live: $HYDRA_DATA_DIR, else ./.data, else the repository's .data."""
    import os

    if os.environ.get("HYDRA_DATA_DIR"):
        return Path(os.environ["HYDRA_DATA_DIR"])
    local = Path.cwd() / ".data"
    return local if local.is_dir() else Path(__file__).resolve().parents[3] / ".data"


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


def load_text_table(
    path: str | Path,
    text_column: str = "text",
    label_column: str | None = "label",
    classes: Sequence[str] | None = None,
) -> TextDataset:
    """Texts (and labels) from a CSV/TSV or JSON Lines file.

    Labels may be integers or class names. ``classes``: the model's class names (e.g.
    ``list(model.config.id2label.values())``), which number the labels: a file holding only some
    classes keeps the model's ids, and a name the model lacks is refused. Without ``classes`` the
    file's own names are sorted into ids (right only for a file holding every class). Without
    ``label_column`` (e.g. OOD data) every label is 0 and ``classes`` is empty.
    """
    import csv
    import json

    path = Path(path)
    rows: list[dict] = []
    csv.field_size_limit(1 << 30)  # long documents are data, not an error
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:  # a byte-order mark is skipped
            if path.suffix in (".jsonl", ".json"):
                for number, line in enumerate(handle, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as exc:
                            raise InputError(f"{path}, line {number}: not JSON ({exc.msg})") from None
                if any(not isinstance(r, dict) for r in rows):
                    raise InputError(f"{path}: every line must be a JSON object")
            else:
                rows = _table_rows(csv.reader(handle, delimiter="\t" if path.suffix == ".tsv" else ","), path)
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except csv.Error as exc:
        raise InputError(f"{path}: malformed {path.suffix[1:].upper()} ({exc})") from None
    if not rows:
        raise InputError(f"{path} holds no rows")
    missing = [c for c in (text_column, label_column) if c and c not in rows[0]]
    if missing:
        raise InputError(f"{path} has no column(s) {missing}; columns: {sorted(rows[0])}")
    texts = checked_texts([r.get(text_column) for r in rows], str(path), text_column)
    ids = [f"{path.name}/{i}" for i in range(len(rows))]
    if not label_column:
        return TextDataset(texts, [0] * len(texts), ids, [])
    labels, names = parse_labels([r.get(label_column) for r in rows], str(path), label_column)
    dataset = TextDataset(texts, labels, ids, names)
    return dataset if classes is None else align_labels(dataset, list(classes), len(classes), str(path))


def _table_rows(reader, path: Path) -> list[dict]:
    """CSV/TSV rows as dicts of the header's columns; ValueError naming the line of a row with
    more or fewer fields than the header (an unquoted comma in a text shifts every later field)."""
    header = next(reader, None)
    if header is None:
        return []
    if len(set(header)) < len(header):
        repeated = sorted({c for c in header if header.count(c) > 1})
        raise InputError(f"{path}: the header names column(s) {repeated} twice")
    rows = []
    for fields in reader:
        if not fields:  # a blank line
            continue
        if len(fields) != len(header):
            raise InputError(
                f"{path}, line {reader.line_num}: {len(fields)} fields where the header has "
                f"{len(header)}: quote texts that contain the delimiter"
            )
        rows.append(dict(zip(header, fields, strict=True)))
    return rows


def check_text_input(value: Any) -> None:
    """Refuse, in one line, what a served text classifier cannot read: anything but a text that
    is not blank (None, numbers, lists, dicts and empty texts)."""
    if not isinstance(value, str):
        raise InputError(
            f"a text classifier takes texts (str), got {type(value).__name__}: pass each input as a "
            "non-empty string"
        )
    if not value.strip():
        raise InputError("an empty text has nothing to classify: pass a non-empty string")


def checked_texts(values: Sequence, source: str, column: str) -> list[str]:
    """A column's values as texts (numbers as their text); ValueError naming ``source`` where one
    is missing or empty, or is an object, a list or a boolean (which no model reads as text)."""
    for row, value in enumerate(values, 1):
        if isinstance(value, (dict, list, tuple, bool)):
            raise InputError(
                f"{source}: row {row}: the {column!r} is a {type(value).__name__}, not a text: "
                "flatten it into a string first"
            )
    texts = ["" if v is None else str(v) for v in values]
    empty = [i + 1 for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise InputError(f"{source}: {len(empty)} rows have an empty {column!r} (first: row {empty[0]})")
    return texts
