"""Class labels of data files mapped onto a model's own classes.

A data file numbers its classes from the names it contains, so two files of one run can number
them differently (a test file that lacks a class shifts every later id). Commands therefore map
each labelled file onto the model's classes before anything is computed: by name where the
model names its classes (``config.id2label``, which ``hydra-ens finetune`` and ``build``
record), as class ids where the file's labels are integers, and by sorted name only where the
model names none and the file holds exactly the model's number of classes. Anything else is an
error, never a renumbering.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence
from typing import TypeVar

from torch import nn

from ..errors import InputError

_GENERIC = re.compile(r"LABEL_\d+")
_WHOLE_NUMBER = re.compile(r"[+-]?\d+(\.0*)?")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")

MAX_CLASS_ID = 99_999
"""Largest class id a label may hold: ids number the classes 0..K-1, so a larger one is a typo
or another column's value (and 10^11 would allocate as many class names)."""
MISSING_NAMES = ("nan",)
"""Label texts that mean "no label" (how a missing value prints), case-insensitive."""


def is_class_id(value: object) -> bool:
    """An integer label (or its text): a class id rather than a class name."""
    return isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())


def _label(value: object) -> int | str | None:
    """One label as a class id (int), a class name (str) or missing (None); ValueError where it
    is neither (a fraction, a list, ...), with the value in the message."""
    if value is None:
        return None
    if isinstance(value, bool):  # before numbers: True is an int, and never meant as class 1
        raise InputError(f"{value!r} (a boolean) is not a class id or a class name: write 0/1 or names")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            return None
        if not math.isfinite(number) or number != int(number):
            raise InputError(f"{value!r} is not a class id (a whole number) or a class name")
        return int(number)
    if isinstance(value, str):
        text = value.strip()
        if not text or text.lower() in MISSING_NAMES:
            return None
        if _WHOLE_NUMBER.fullmatch(text):
            return int(float(text)) if "." in text else int(text)
        if _NUMBER.fullmatch(text):
            raise InputError(f"{value!r} is not a class id (a whole number) or a class name")
        return text
    raise InputError(f"{value!r} ({type(value).__name__}) is not a class id or a class name")


def parse_labels(values: Sequence, source: str, column: str) -> tuple[list[int], list[str]]:
    """The one label parser of every data format (CSV/TSV, JSON Lines, Hugging Face datasets,
    ``.npz``): integer labels and their class names.

    A label is a class id (an integer, a whole float, or their text: ``0``, ``0.0``, ``"0"`` and
    ``" 0 "`` are one class; classes ``"0"`` to the largest id) or a class name (text without
    its surrounding spaces; classes sorted). ValueError naming ``source``, ``column`` and the first
    offending row for: a missing label (None, empty, NaN), a number that is not whole (``1.7``),
    a negative id or one above `MAX_CLASS_ID`, ids mixed with names, or any other value.
    """
    labels: list[int | str] = []
    missing = []
    for row, value in enumerate(values, 1):
        try:
            label = _label(value)
        except ValueError as exc:
            raise InputError(f"{source}: row {row}: the {column!r} {exc}") from None
        if label is None:
            missing.append(row)
        labels.append(label)
    if missing:
        raise InputError(f"{source}: {len(missing)} rows have no {column!r} (first: row {missing[0]})")
    ids = [i for i, label in enumerate(labels) if isinstance(label, int)]
    if ids and len(ids) < len(labels):
        name = next(i for i, label in enumerate(labels) if isinstance(label, str))
        raise InputError(
            f"{source}: the {column!r} column mixes class ids (row {ids[0] + 1}: {labels[ids[0]]}) and "
            f"class names (row {name + 1}: {labels[name]!r}): use one kind for every row"
        )
    if ids:
        low, high = min(labels), max(labels)
        if low < 0:
            raise InputError(f"{source}: integer labels are class ids and must be >= 0, found {low}")
        if high > MAX_CLASS_ID:
            raise InputError(
                f"{source}: class id {high} in {column!r} is implausible (ids number the classes "
                f"0..K-1, at most {MAX_CLASS_ID}): is it the right column?"
            )
        return [int(label) for label in labels], [str(c) for c in range(high + 1)]
    classes = sorted(set(labels))
    index = {name: i for i, name in enumerate(classes)}
    return [index[label] for label in labels], classes


def check_trainable(labels: Sequence[int], classes: Sequence[str], source: str) -> None:
    """Refuse training data a classifier cannot learn from: fewer than two classes present."""
    present = sorted(set(labels))
    if len(present) < 2:
        only = classes[present[0]] if present and present[0] < len(classes) else "?"
        raise InputError(
            f"{source}: every label is {only!r}: training needs examples of at least two classes"
        )


D = TypeVar("D")


def model_class_names(model: nn.Module | Sequence[nn.Module]) -> list[str] | None:
    """The class names a classifier's head predicts (``config.id2label``), or None where the
    config holds only Hugging Face's placeholders (``LABEL_0``, ...). Several models (an explicit
    ensemble, or the methods of one evaluation) must not name different classes; models naming
    none take class ids and follow the others' names."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        named = [n for n in (model_class_names(m) for m in model) if n is not None]
        for other in named[1:]:
            if other != named[0]:
                how = (
                    "the same classes in another order"
                    if sorted(other) == sorted(named[0])
                    else "different classes"
                )
                raise InputError(
                    f"the models name {how}: {named[0]} and {other}: compared or ensembled models must "
                    "predict the same classes in the same order"
                )
        return named[0] if named else None
    id2label = getattr(model.config, "id2label", None) or {}
    names = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(len(id2label))]
    if not names or all(_GENERIC.fullmatch(n) for n in names):
        return None
    return names


def num_model_labels(model: nn.Module | Sequence[nn.Module]) -> int:
    """Classes of a classifier's head (every model of an explicit ensemble must agree)."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        counts = {num_model_labels(m) for m in model}
        if len(counts) != 1:
            raise InputError(
                f"the models have different numbers of classes ({sorted(counts)}): compared or ensembled "
                "models must predict the same classes"
            )
        return counts.pop()
    return int(model.config.num_labels)


def check_same_classes(models: Sequence[nn.Module]) -> None:
    """The one rule for models compared with each other (eval's methods, a sweep's candidates and
    the models it compares), whose measures read one labelling of the data: the same number of
    classes, and the same class names in the same order wherever models name them (a model
    naming none takes class ids and follows the others: `model_class_names`); InputError naming
    the classes otherwise."""
    num_model_labels(models)
    model_class_names(models)


def align_labels(dataset: D, model_names: list[str] | None, num_labels: int, source: str) -> D:
    """``dataset`` (a ``TextDataset`` or ``ImageDataset``) with labels numbered as the model's
    classes, and ``classes`` the model's names (or the file's, where the model names none).

    Raises ValueError, naming ``source``, where a class cannot be placed: a name the model does
    not know, an id outside ``num_labels``, or names the model cannot tell apart.
    """
    names = list(dataset.classes)
    if not names:  # unlabelled data: nothing to map
        return dataset
    if model_names is not None and all(n in model_names for n in names):
        ids = [model_names.index(n) for n in names]
    elif all(is_class_id(n) for n in names):  # integer labels are class ids
        ids = [int(n) for n in names]
    elif model_names is not None:
        unknown = [n for n in names if n not in model_names]
        raise InputError(f"{source}: classes {unknown} are not classes of the model {model_names}")
    elif len(names) == num_labels:  # the model names none: sorted names <-> ids, as when training
        ids = list(range(num_labels))
    else:
        raise InputError(
            f"{source} names {len(names)} classes {names}, but the model's {num_labels} classes have no "
            "names, so which id each name means is unknown: give labels as class ids 0.."
            f"{num_labels - 1}, or use a model that names its classes (hydra-ens finetune records them)"
        )
    used = sorted({ids[y] for y in dataset.labels})
    outside = [i for i in used if not 0 <= i < num_labels]
    if outside:
        raise InputError(f"{source}: class ids {outside} are outside the model's {num_labels} classes")
    classes = model_names or (
        [str(i) for i in range(num_labels)] if all(is_class_id(n) for n in names) else names
    )
    return dataclasses.replace(dataset, labels=[ids[y] for y in dataset.labels], classes=list(classes))
