"""Distribution shift: seeded corruptions at severities 1-5, for images and for text.

Images (float arrays (N, C, H, W) in [0, 1]), after ImageNet-C (Hendrycks & Dietterich 2019),
with parameters scaled for small images: gaussian_noise, shot_noise, gaussian_blur, contrast,
brightness, pixelate. Text: char_typos (swap, drop, insert or replace letters), word_dropout,
word_swap (adjacent words). Every corruption is deterministic given (seed, severity, item id).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..data import ImageDataset, TextDataset, stable_sample, stable_unit
from ..errors import InputError

SEVERITIES = (1, 2, 3, 4, 5)


def _check(severity: int) -> int:
    if severity not in SEVERITIES:
        raise InputError(f"severity must be one of {SEVERITIES}, got {severity}")
    return severity - 1


# ----------------------------------------------------------------------------- images
def gaussian_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    std = (0.08, 0.12, 0.18, 0.26, 0.38)[_check(severity)]
    return np.clip(x + rng.normal(0, std, x.shape), 0, 1)


def shot_noise(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    lam = (60, 25, 12, 5, 3)[_check(severity)]
    return np.clip(rng.poisson(x * lam) / lam, 0, 1)


def gaussian_blur(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    sigma = (0.5, 0.75, 1.0, 1.5, 2.0)[_check(severity)]
    radius = int(np.ceil(3 * sigma))
    grid = np.arange(-radius, radius + 1)
    kernel = np.exp(-(grid**2) / (2 * sigma**2))
    kernel = torch.tensor(kernel / kernel.sum(), dtype=torch.float32)
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    c = t.shape[1]
    horizontal = kernel.view(1, 1, 1, -1).repeat(c, 1, 1, 1)
    vertical = kernel.view(1, 1, -1, 1).repeat(c, 1, 1, 1)
    t = F.conv2d(F.pad(t, (radius, radius, 0, 0), mode="reflect"), horizontal, groups=c)
    t = F.conv2d(F.pad(t, (0, 0, radius, radius), mode="reflect"), vertical, groups=c)
    return t.numpy()


def contrast(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    c = (0.4, 0.3, 0.2, 0.1, 0.05)[_check(severity)]
    mean = x.mean(axis=(1, 2, 3), keepdims=True)
    return np.clip((x - mean) * c + mean, 0, 1)


def brightness(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(x + (0.1, 0.2, 0.3, 0.4, 0.5)[_check(severity)], 0, 1)


def pixelate(x: np.ndarray, severity: int, rng: np.random.Generator) -> np.ndarray:
    factor = (0.8, 0.6, 0.5, 0.4, 0.3)[_check(severity)]
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    h, w = t.shape[-2:]
    small = F.interpolate(t, size=(max(1, int(h * factor)), max(1, int(w * factor))), mode="area")
    return F.interpolate(small, size=(h, w), mode="nearest").numpy()


IMAGE_CORRUPTIONS: dict[str, Callable] = {
    f.__name__: f for f in (gaussian_noise, shot_noise, gaussian_blur, contrast, brightness, pixelate)
}


def corrupt_images(data: ImageDataset, name: str, severity: int, seed: int = 0) -> ImageDataset:
    """``data`` with corruption ``name`` at ``severity`` (same noise for the same seed)."""
    if name not in IMAGE_CORRUPTIONS:
        raise InputError(f"unknown image corruption {name!r}; choose from {sorted(IMAGE_CORRUPTIONS)}")
    rng = np.random.default_rng([seed, severity, sorted(IMAGE_CORRUPTIONS).index(name)])
    images = IMAGE_CORRUPTIONS[name](data.images.astype(np.float64), severity, rng).astype(np.float32)
    return ImageDataset(images, list(data.labels), list(data.ids), data.classes)


# ----------------------------------------------------------------------------- text
def _typos(text: str, p: float, rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    chars = list(text)
    i = 0
    while i < len(chars):
        ch = chars[i]
        if ch.isalpha() and rng.random() < p:
            op = rng.randrange(4)
            if op == 0 and i + 1 < len(chars):  # swap with the next character
                out += [chars[i + 1], ch]
                i += 2
                continue
            if op == 1:  # drop
                i += 1
                continue
            if op == 2:  # insert
                out += [ch, rng.choice(letters)]
            else:  # replace
                out.append(rng.choice(letters))
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def char_typos(text: str, severity: int, rng: random.Random) -> str:
    return _typos(text, (0.02, 0.04, 0.07, 0.1, 0.15)[_check(severity)], rng)


def word_dropout(text: str, severity: int, rng: random.Random) -> str:
    p = (0.05, 0.1, 0.2, 0.3, 0.45)[_check(severity)]
    words = text.split()
    kept = [w for w in words if rng.random() >= p]
    return " ".join(kept or words[:1])


def word_swap(text: str, severity: int, rng: random.Random) -> str:
    p = (0.05, 0.1, 0.2, 0.3, 0.45)[_check(severity)]
    words = text.split()
    i = 0
    while i < len(words) - 1:
        if rng.random() < p:
            words[i], words[i + 1] = words[i + 1], words[i]
            i += 2
        else:
            i += 1
    return " ".join(words)


TEXT_CORRUPTIONS: dict[str, Callable] = {f.__name__: f for f in (char_typos, word_dropout, word_swap)}


def corrupt_texts(data: TextDataset, name: str, severity: int, seed: int = 0) -> TextDataset:
    """``data`` with text corruption ``name`` at ``severity``; each text seeded by its id."""
    if name not in TEXT_CORRUPTIONS:
        raise InputError(f"unknown text corruption {name!r}; choose from {sorted(TEXT_CORRUPTIONS)}")
    fn = TEXT_CORRUPTIONS[name]
    texts = [
        fn(text, severity, random.Random(stable_unit(item, f"{name}:{severity}:{seed}")))
        for text, item in zip(data.texts, data.ids, strict=True)
    ]
    return TextDataset(texts, list(data.labels), list(data.ids), data.classes)


def shifted_sets(
    dataset: ImageDataset | TextDataset, limit: int | None = None, seed: int = 0
) -> dict[tuple[str, int], ImageDataset | TextDataset]:
    """A fixed sample of at most ``limit`` items of ``dataset`` (the same for every method and
    run: `data.stable_sample`) under every corruption of its modality at severities 1-5."""
    base = dataset.subset(stable_sample(range(len(dataset)), dataset.ids, limit, salt="shift"))
    if isinstance(base, ImageDataset):
        names, corrupt = IMAGE_CORRUPTIONS, corrupt_images
    else:
        names, corrupt = TEXT_CORRUPTIONS, corrupt_texts
    return {
        (name, severity): corrupt(base, name, severity, seed=seed)
        for name in names
        for severity in SEVERITIES
    }
