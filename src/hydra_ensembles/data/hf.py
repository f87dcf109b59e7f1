"""Hugging Face ``datasets`` as data: a ``save_to_disk`` folder, parquet/arrow files, or a hub id
already in the local cache (nothing is downloaded behind the user's back: set up the cache first).

Columns are chosen by option or guessed from the features: the text column is the only string
feature (or one named text/sentence/content/review/document), the image column the ``Image``
feature, the label column the ``ClassLabel`` feature, whose names become the class names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError
from .images import ImageDataset, pil_array, stack_images
from .labels import parse_labels
from .text import TextDataset, checked_texts

TEXT_NAMES = ("text", "sentence", "content", "review", "document")
ARROW_SUFFIXES = (".parquet", ".arrow")


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        raise InputError(
            "Hugging Face datasets need the package datasets: pip install 'hydra-ensembles[data]'"
        ) from exc
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def load_hf(
    source: str,
    split: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    labelled: bool = True,
) -> TextDataset | ImageDataset:
    """One split of a Hugging Face dataset as a `TextDataset` or `ImageDataset`.

    ``source``: a ``save_to_disk`` folder, a ``.parquet``/``.arrow`` file, or a hub id (with an
    optional ``@config``) in the local cache. ``split`` defaults to ``test`` where there are
    several, else the only one. A column named by ``text_column`` or ``label_column`` must exist
    (and hold text, for the text); unnamed, they are guessed from the features (see the module
    docstring). ``labelled=False`` loads unlabelled data (e.g. OOD).
    """
    datasets = _datasets()
    path = Path(source)
    try:
        if is_saved_dataset(path):
            data = datasets.load_from_disk(str(path))
        elif path.suffix in ARROW_SUFFIXES:
            if not path.is_file():
                raise InputError(f"data file {source!r} does not exist")
            kind = "parquet" if path.suffix == ".parquet" else "arrow"
            data = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            name, _, config = source.partition("@")
            data = datasets.load_dataset(name, config or None)
    except (FileNotFoundError, ConnectionError) as exc:
        raise InputError(
            f"Hugging Face dataset {source!r} is neither a saved folder nor in the local cache "
            f"({type(exc).__name__}); save it with Dataset.save_to_disk, or download it once with "
            "datasets.load_dataset where a network is available"
        ) from None
    except (OSError, datasets.exceptions.DatasetNotFoundError) as exc:
        raise InputError(f"cannot read the Hugging Face dataset {source!r}: {exc}") from None
    if isinstance(data, datasets.DatasetDict):
        names = sorted(data)
        if split is None:
            split = "test" if "test" in data else names[0] if len(names) == 1 else None
        if split not in data:
            raise InputError(f"{source} has splits {names}; name one as {source}:SPLIT")
        data = data[split]
    elif split not in (None, "train"):
        raise InputError(f"{source} is a single split; drop ':{split}'")
    name = f"{path.name or source}:{split or 'all'}"
    return _convert(data, name, text_column, label_column if labelled else None, labelled)


def _convert(data: Any, name: str, text_column: str | None, label_column: str | None, labelled: bool):
    features = data.features
    if len(data) == 0:
        raise InputError(f"{name} holds no rows")
    image_column = next((c for c, f in features.items() if type(f).__name__ == "Image"), None)
    label_column = _label_column(features, name, label_column, required=labelled)
    labels, classes = _labels(data, name, label_column) if labelled else ([0] * len(data), [])
    ids = [f"{name}/{i}" for i in range(len(data))]
    if image_column is not None:
        from PIL.Image import DecompressionBombError  # images only: pillow is the images extra

        grey = ("L", "1", "I", "F")
        try:
            arrays = [pil_array(image, grayscale=image.mode in grey) for image in data[image_column]]
        except (OSError, DecompressionBombError) as exc:
            raise InputError(f"{name}: an image is not readable ({' '.join(str(exc).split())})") from None
        return ImageDataset(stack_images(arrays, name), labels, ids, classes)
    column = _text_column(features, name, text_column, label_column)
    return TextDataset(checked_texts(data[column], name, column), labels, ids, classes)


def _kind(feature: Any) -> str:
    return getattr(feature, "dtype", None) or type(feature).__name__


def _text_column(features: dict, name: str, wanted: str | None, label_column: str | None) -> str:
    """The named text column (it must exist and hold strings), else the one a guess finds."""
    strings = [c for c, f in features.items() if _kind(f) in ("string", "large_string")]
    if wanted is not None:
        if wanted not in features:
            raise InputError(f"{name}: no column {wanted!r} (--text-column) among {sorted(features)}")
        if wanted not in strings:
            raise InputError(f"{name}: column {wanted!r} holds {_kind(features[wanted])}, not text")
        return wanted
    named = [c for c in TEXT_NAMES if c in features]
    if named:
        if named[0] not in strings:
            raise InputError(
                f"{name}: column {named[0]!r} holds {_kind(features[named[0]])}, not text: "
                "name the text column with --text-column"
            )
        return named[0]
    candidates = [c for c in strings if c != label_column]
    if len(candidates) == 1:
        return candidates[0]
    raise InputError(
        f"{name}: cannot tell which column holds the text among {candidates}: pass --text-column"
    )


def _label_column(features: dict, name: str, wanted: str | None, required: bool) -> str | None:
    """The named label column (it must exist), else ``label`` or the only ``ClassLabel``."""
    if wanted is not None:
        if wanted not in features:
            raise InputError(f"{name}: no label column {wanted!r} (--label-column) among {sorted(features)}")
        return wanted
    if "label" in features:
        return "label"
    class_labels = [c for c, f in features.items() if type(f).__name__ == "ClassLabel"]
    if len(class_labels) == 1:
        return class_labels[0]
    if required:
        raise InputError(
            f"{name}: cannot tell which column holds the labels among {sorted(features)}: pass --label-column"
        )
    return None


def _labels(data: Any, name: str, column: str) -> tuple[list[int], list[str]]:
    features = data.features
    values = list(data[column])
    if all(isinstance(v, int) and v < 0 for v in values):  # e.g. GLUE's test splits: all -1
        raise InputError(f"{name} has no labels (every {column!r} is {values[0]}): use a labelled split")
    labels, classes = parse_labels(values, name, column)
    feature = features[column]
    return labels, list(feature.names) if type(feature).__name__ == "ClassLabel" else classes
