"""Fit the Mahalanobis scores' feature statistics over labelled training data read as a Ray
dataset: workers compute the members' features once (kept in Ray's object store), two passes of
sums over their blocks (`ood.moments`: class sums, then scatter and fourth powers around the final
means) are added up on the driver in any order, and the statistics follow: equal to
`FeatureStatistics.fit` on the same rows to float64 rounding (``mds``, ``rmds``, ``mds++``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InputError
from .cluster import READ_CPUS, RayPlan, require_ray
from .scoring import ModelWorker

__all__ = ["fit_statistics_dataset"]


def _read_labelled(
    batch: dict[str, np.ndarray], columns: tuple, classes: list[str] | None, num_labels: int
) -> dict:
    """The texts and class ids (the model's numbering) of the files in ``batch["path"]``."""
    from ..data import load_spec
    from ..data.labels import align_labels

    texts, labels = [], []
    for path in batch["path"]:
        dataset = align_labels(load_spec(str(path), *columns), classes, num_labels, str(path))
        if not hasattr(dataset, "texts"):
            raise InputError(f"{path} holds no texts; --engine ray reads text tables")
        texts += dataset.texts
        labels += list(dataset.labels)
    return {"text": texts, "label": np.asarray(labels, np.int64)}


class _Featurizer(ModelWorker):
    """One worker: each batch's members' features (float64)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..data import model_batches
        from ..data.text import TextDataset
        from ..evaluation.predict import predict

        s, labels = self.settings, [int(label) for label in batch["label"]]
        texts = [str(t) for t in batch["text"]]
        dataset = TextDataset(texts, labels, [str(i) for i in range(len(texts))], list(s["classes"]))
        _, batches = model_batches(
            dataset,
            self.model,
            self.preprocessor,
            s["batch_size"],
            s["max_length"],
            True,
            "the training data",
        )
        preds = predict(self.model, batches, "features", progress=False, precision=s["precision"])
        if preds.member_features is None:
            raise InputError("the model's logits are not one affine map of one feature vector per member")
        features = np.asarray(preds.member_features, np.float64).transpose(1, 0, 2)  # (B, M, D)
        return {"features": features, "label": np.asarray(labels, np.int64)}


def _first(batch: dict[str, np.ndarray], classes: int) -> dict[str, np.ndarray]:
    from ..ood.moments import first_sums

    sums = first_sums(batch["features"].transpose(1, 0, 2), batch["label"], classes)
    return {key: value[None] for key, value in sums.items()}


def _second(batch: dict[str, np.ndarray], first: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from ..ood.moments import second_sums

    sums = second_sums(batch["features"].transpose(1, 0, 2), batch["label"], first)
    return {key: value[None] for key, value in sums.items()}


def fit_statistics_dataset(
    model: str,
    files: Sequence[str | os.PathLike],
    plan: RayPlan,
    *,
    classes: Sequence[str] | None,
    num_labels: int,
    batch_size: int = 32,
    max_length: int = 128,
    precision: str = "auto",
    text_column: str | None = None,
    label_column: str | None = None,
    preprocessor: str | None = None,
) -> Any:
    """The `FeatureStatistics` of ``mds``, ``rmds`` and ``mds++`` of the saved ``model`` over the
    labelled rows of ``files`` (`scoring.data_files`), computed on ``plan``'s workers; the class
    names ``classes`` (the model's; None: class ids) number the files' labels as `predict` does."""
    ray = require_ray()
    from ..ood.moments import add, statistics_from_sums

    paths = ray.data.from_items([{"path": str(f)} for f in files], override_num_blocks=len(files))
    kwargs = {"columns": (text_column, label_column), "classes": classes, "num_labels": num_labels}
    rows = paths.map_batches(_read_labelled, batch_size=1, fn_kwargs=kwargs, num_cpus=READ_CPUS)
    settings = {
        "classes": list(classes) if classes else [str(c) for c in range(num_labels)],
        "batch_size": batch_size,
        "max_length": max_length,
        "precision": precision,
        "threads": plan.threads,
        "preprocessor": preprocessor,
    }
    features = rows.map_batches(
        _Featurizer,
        fn_constructor_args=(str(model), settings),
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=plan.workers),
        num_cpus=1,
        batch_format="numpy",
    ).materialize()
    first = add(
        _rows(features.map_batches(_first, fn_kwargs={"classes": num_labels}, num_cpus=READ_CPUS).take_all())
    )
    second_blocks = features.map_batches(_second, fn_kwargs={"first": first}, num_cpus=READ_CPUS).take_all()
    return statistics_from_sums(first, add(_rows(second_blocks)), num_labels)


def _rows(rows: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
    return [{key: np.asarray(value, np.float64) for key, value in row.items()} for row in rows]
