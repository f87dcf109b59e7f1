"""Image datasets: arrays (N, C, H, W) in [0, 1] with integer labels, and their batches."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .text import MissingDataError

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


@dataclass(frozen=True)
class ImageDataset:
    """Images as float32 (N, C, H, W) in [0, 1], integer labels, stable ids and class names."""

    images: np.ndarray
    labels: list[int]
    ids: list[str]
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Sequence[int]) -> ImageDataset:
        idx = list(indices)
        return ImageDataset(
            self.images[idx], [self.labels[i] for i in idx], [self.ids[i] for i in idx], self.classes
        )


def image_batches(
    dataset: ImageDataset, batch_size: int = 64, mean: float = 0.5, std: float = 0.5
) -> Iterator[dict[str, torch.Tensor]]:
    """``{"pixel_values", "labels"}`` batches, normalised as (x - mean) / std."""
    for start in range(0, len(dataset), batch_size):
        end = start + batch_size
        pixels = (torch.from_numpy(dataset.images[start:end]).float() - mean) / std
        yield {"pixel_values": pixels, "labels": torch.tensor(dataset.labels[start:end])}


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    _, dtype, ndim = struct.unpack(">HBB", data[:4])
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    if dtype != 0x08:
        raise ValueError(f"{path}: unsupported idx dtype {dtype:#x}")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(split: str = "train", root: Path = FASHION_MNIST_DIR) -> ImageDataset:
    """Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (idx .gz files); ids ``split/index``."""
    prefix = {"train": "train", "test": "t10k"}.get(split)
    if prefix is None:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    images_file = root / f"{prefix}-images-idx3-ubyte.gz"
    labels_file = root / f"{prefix}-labels-idx1-ubyte.gz"
    if not images_file.is_file():
        raise MissingDataError(f"Fashion-MNIST not found in {root}: apt-get install dataset-fashion-mnist")
    images = _read_idx(images_file).astype(np.float32)[:, None] / 255.0
    labels = _read_idx(labels_file).astype(int).tolist()
    return ImageDataset(images, labels, [f"{split}/{i}" for i in range(len(labels))], FASHION_MNIST_CLASSES)


def load_npz(path: str | Path) -> ImageDataset:
    """An ``.npz`` with ``x`` (N, H, W) or (N, C, H, W) (uint8 0-255 or float 0-1) and ``y`` (N,)."""
    with np.load(path, allow_pickle=False) as data:
        if "x" not in data or "y" not in data:
            raise ValueError(f"{path} must hold arrays 'x' and 'y'")
        x, y = data["x"], data["y"]
        classes = [str(c) for c in data["classes"]] if "classes" in data else None
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or len(x) != len(y):
        raise ValueError(f"{path}: x must be (N, H, W) or (N, C, H, W) with N = len(y)")
    x = x.astype(np.float32) / (255.0 if np.issubdtype(x.dtype, np.integer) or x.max() > 1 else 1.0)
    labels = y.astype(int).tolist()
    classes = classes or [str(c) for c in range(max(labels) + 1)]
    return ImageDataset(x, labels, [f"{Path(path).name}/{i}" for i in range(len(labels))], classes)


def load_image_folder(path: str | Path, size: int | None = None, grayscale: bool = False) -> ImageDataset:
    """``path/<class>/<image>`` files (any format Pillow reads); classes in sorted order."""
    from PIL import Image

    root = Path(path)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{root} has no class sub-folders")
    images, labels, ids = [], [], []
    for label, name in enumerate(classes):
        for file in sorted((root / name).iterdir()):
            if not file.is_file():
                continue
            with Image.open(file) as image:
                image = image.convert("L" if grayscale else "RGB")
                if size is not None:
                    image = image.resize((size, size))
                array = np.asarray(image, dtype=np.float32) / 255.0
            images.append(array[None] if grayscale else array.transpose(2, 0, 1))
            labels.append(label)
            ids.append(f"{name}/{file.name}")
    shapes = {a.shape for a in images}
    if len(shapes) != 1:
        raise ValueError(f"images in {root} differ in size {sorted(shapes)}; pass size=")
    return ImageDataset(np.stack(images), labels, ids, classes)
