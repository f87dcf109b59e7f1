"""Image datasets: arrays (N, C, H, W) in [0, 1] with integer labels, and their batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError


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
    classes, files = image_folder_files(path)
    images = [read_image(file, grayscale, size) for _, _, file in files]
    return ImageDataset(
        stack_images(images, str(path)), [c for c, _, _ in files], [i for _, i, _ in files], classes
    )


def image_folder_files(path: str | Path) -> tuple[list[str], list[tuple[int, str, Path]]]:
    """The classes of an image folder ``path/<class>/<image>`` (its sub-folders, sorted) and its
    images as (class id, id ``<class>/<file>``, file), hidden files left out; InputError for a
    folder without classes or images, or a class folder holding folders."""
    root = Path(path)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise InputError(f"{root} has no class sub-folders")
    files = []
    for label, name in enumerate(classes):
        nested = sorted(p.name for p in (root / name).iterdir() if p.is_dir())
        if nested:  # its images would be left out without a word
            raise InputError(
                f"{root / name} holds folders ({', '.join(nested[:3])}): an image folder is "
                "<class>/<image>, one level; move their images up or into their own class folders"
            )
        for file in sorted((root / name).iterdir()):
            if file.is_file() and not file.name.startswith("."):
                files.append((label, f"{name}/{file.name}", file))
    if not files:
        raise InputError(f"{root} has class sub-folders but no images")
    return classes, files


def read_image(
    file: Any,
    grayscale: bool = False,
    size: int | None = None,
    *,
    name: str | None = None,
    max_pixels: int | None = None,
) -> np.ndarray:
    """One image file (a path or a binary file object) as float32 (C, H, W) in [0, 1]
    (`pil_array`); InputError naming it (``name``, else the file) where Pillow cannot read it
    safely, or where it holds more than ``max_pixels`` pixels (checked before decoding)."""
    from PIL import Image

    name = name or str(file)
    try:
        with Image.open(file) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise InputError(
                    f"{name} is {image.width} x {image.height} pixels; at most {max_pixels} pixels per image"
                )
            return pil_array(image, grayscale, size)
    except (OSError, Image.DecompressionBombError) as exc:  # not an image Pillow reads safely
        raise InputError(f"{name} is not a readable image ({' '.join(str(exc).split())})") from None


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
