"""The embedded benchmarks: the paper's protocol scaled to offline data (DATA.md).

Text (the default): ID = BBC News without "tech" (business, entertainment, politics, sports);
near-OOD = BBC "tech" (same source, unseen topic); far-OOD = drug reviews (drugs.com) and
fortune cookies (Debian fortunes-min); OOD validation for circuit extraction = SpamAssassin
emails, which never appear in the OOD table. Shift = character typos, word dropout and word
swaps at severities 1-5 on the ID test set.

Every split is fixed by a SHA-256 hash of each item's id (``data.splits``), so it is identical
for every method, run and machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .data import (
    TextDataset,
    load_bbc_news,
    load_drug_reviews,
    load_fortunes,
    load_spam_assassin,
    split_indices,
    stable_sample,
)
from .evaluation.shift import TEXT_CORRUPTIONS, corrupt_texts

ID_TOPICS = ("business", "entertainment", "politics", "sports")
NEAR_TOPIC = "tech"
SPLITS = {"train": 0.6, "val": 0.2, "test": 0.2}
SPLIT_SALT = "bbc-news"


def data_dir() -> Path:
    """Where downloaded corpora live: $HYDRA_DATA_DIR, else ./.data, else the repository's .data."""
    if os.environ.get("HYDRA_DATA_DIR"):
        return Path(os.environ["HYDRA_DATA_DIR"])
    local = Path.cwd() / ".data"
    return local if local.is_dir() else Path(__file__).resolve().parents[2] / ".data"


@dataclass
class TextTask:
    """All data of the text benchmark, already split."""

    train: TextDataset
    val: TextDataset
    test: TextDataset
    ood_val: TextDataset
    ood_test: dict[str, tuple[str, TextDataset]]  # name -> (near|far, data)
    shift: dict[tuple[str, int], TextDataset] = field(default_factory=dict)

    @property
    def classes(self) -> list[str]:
        return self.train.classes

    def describe(self) -> dict[str, str]:
        ood = ", ".join(f"{n} ({k}, {len(d)})" for n, (k, d) in self.ood_test.items())
        sizes = f"train {len(self.train)}, val {len(self.val)}, test {len(self.test)}"
        out = {
            "ID": f"BBC News {list(ID_TOPICS)}: {sizes}",
            "OOD test": ood,
            "OOD validation (circuit extraction only)": f"SpamAssassin easy-ham ({len(self.ood_val)})",
        }
        if self.shift:
            corruptions = sorted({c for c, _ in self.shift})
            count = len(next(iter(self.shift.values())))
            out["shift"] = f"{corruptions} x severities 1-5 on {count} ID test texts"
        return out


def load_text_task(
    train_limit: int | None = None,
    test_limit: int | None = None,
    ood_limit: int | None = 300,
    ood_val_limit: int = 200,
    shift_limit: int | None = 200,
    spam_dir: str | Path | None = None,
    seed: int = 0,
) -> TextTask:
    """The text benchmark; limits subsample deterministically (by hash) for quick runs."""
    data = load_bbc_news((*ID_TOPICS, NEAR_TOPIC))
    parts = split_indices(data.ids, SPLITS, salt=SPLIT_SALT)
    near = data.classes.index(NEAR_TOPIC)

    def id_part(name: str, limit: int | None) -> TextDataset:
        chosen = [i for i in parts[name] if data.labels[i] != near]
        subset = data.subset(stable_sample(chosen, data.ids, limit, salt=name))
        return TextDataset(subset.texts, subset.labels, subset.ids, list(ID_TOPICS))

    def sample(dataset: TextDataset, limit: int | None, salt: str) -> TextDataset:
        return dataset.subset(stable_sample(range(len(dataset)), dataset.ids, limit, salt=salt))

    train, val, test = id_part("train", train_limit), id_part("val", None), id_part("test", test_limit)
    # "tech" never trains or validates anything, so its val and test parts both serve as near-OOD
    tech = data.subset([i for name in ("val", "test") for i in parts[name] if data.labels[i] == near])
    ood_test = {
        "bbc-tech": ("near", sample(tech, ood_limit, "near")),
        "drug-reviews": ("far", sample(load_drug_reviews(), ood_limit, "drugs")),
        "fortunes": ("far", sample(load_fortunes(), ood_limit, "fortunes")),
    }
    spam = load_spam_assassin(spam_dir or data_dir() / "spam-assassin")
    ood_val = sample(spam, ood_val_limit, "spam")
    shift_base = sample(test, shift_limit, "shift")
    shift = {
        (name, severity): corrupt_texts(shift_base, name, severity, seed=seed)
        for name in TEXT_CORRUPTIONS
        for severity in range(1, 6)
    }
    return TextTask(train, val, test, ood_val, ood_test, shift)
