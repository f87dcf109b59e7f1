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
import re
from collections.abc import Sequence
from typing import TypeVar

from torch import nn

from .text import is_class_id

_GENERIC = re.compile(r"LABEL_\d+")

D = TypeVar("D")


def model_class_names(model: nn.Module | Sequence[nn.Module]) -> list[str] | None:
    """The class names a classifier's head predicts (``config.id2label``), or None where the
    config holds only Hugging Face's placeholders (``LABEL_0``, ...). Several models (an explicit
    ensemble, or the methods of one evaluation) must not name different classes; models naming
    none take class ids and follow the others' names."""
    if isinstance(model, Sequence) and not isinstance(model, nn.Module):
        named = [n for n in (model_class_names(m) for m in model) if n is not None]
        if any(n != named[0] for n in named):
            raise ValueError(f"the models name different classes: {named}")
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
            raise ValueError(f"the ensemble's models have different numbers of classes: {sorted(counts)}")
        return counts.pop()
    return int(model.config.num_labels)


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
        raise ValueError(f"{source}: classes {unknown} are not classes of the model {model_names}")
    elif len(names) == num_labels:  # the model names none: sorted names <-> ids, as when training
        ids = list(range(num_labels))
    else:
        raise ValueError(
            f"{source} names {len(names)} classes {names}, but the model's {num_labels} classes have no "
            "names, so which id each name means is unknown: give labels as class ids 0.."
            f"{num_labels - 1}, or use a model that names its classes (hydra-ens finetune records them)"
        )
    used = sorted({ids[y] for y in dataset.labels})
    outside = [i for i in used if not 0 <= i < num_labels]
    if outside:
        raise ValueError(f"{source}: class ids {outside} are outside the model's {num_labels} classes")
    classes = model_names or (
        [str(i) for i in range(num_labels)] if all(is_class_id(n) for n in names) else names
    )
    return dataclasses.replace(dataset, labels=[ids[y] for y in dataset.labels], classes=list(classes))
