"""Fit the feature scores' statistics over labelled training data read as a Ray dataset: workers
compute the members' features once (and every layer's tokens where a score reads them; kept in
Ray's object store in the precision they were computed in, at most float32), each score's passes
summarise every block where it is kept (`ood.passes`: sums, means and spreads, the kNN bank's
rows), the driver merges the summaries in any order and fits what they determine, and the
statistics follow: equal to `FeatureStatistics.fit` on the same rows in the order of the files,
to float64 rounding, for every score fit in passes (every built-in one)."""

from __future__ import annotations

import collections
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
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

    texts, labels, files, rows = [], [], [], []
    for number, path in zip(batch["file"], batch["path"], strict=True):
        dataset = align_labels(load_spec(str(path), *columns), classes, num_labels, str(path))
        if not hasattr(dataset, "texts"):
            raise InputError(f"{path} holds no texts; --engine ray reads text tables")
        texts += dataset.texts
        labels += list(dataset.labels)
        files += [int(number)] * len(dataset.texts)
        rows += range(len(dataset.texts))
    return {"text": texts, "label": np.asarray(labels, np.int64), "file": np.asarray(files, np.int64),
            "row": np.asarray(rows, np.int64)}  # fmt: skip


def _read_labelled_images(
    batch: dict[str, np.ndarray], folder_classes: list[str], classes: list[str] | None, num_labels: int
) -> dict:
    """The images of ``batch["path"]`` and their class ids: the model's numbering (``classes``,
    ``num_labels``) of their folder's classes ``folder_classes`` (all of them, as `predict`
    numbers an image folder's, whichever a part holds), ``batch["folder_class"]`` each."""
    from ..data.images import ImageDataset, read_image, stack_images
    from ..data.labels import align_labels

    images = stack_images([read_image(str(path)) for path in batch["path"]], "the image folder")
    labels = [int(c) for c in batch["folder_class"]]
    dataset = ImageDataset(images, labels, [str(p) for p in batch["path"]], list(folder_classes))
    dataset = align_labels(dataset, classes, num_labels, "the image folder")
    return {
        "image": images,
        "label": np.asarray(dataset.labels, np.int64),
        "file": batch["file"],
        "row": batch["row"],
    }


def _labelled_rows(files: Sequence, read: dict) -> Any:
    """The labelled rows of ``files`` as a Ray dataset: a table per read task (`_read_labelled`),
    or an image folder's images in parts (`_read_labelled_images`), in `load_spec`'s order."""
    from ..data.images import image_folder_files
    from .scoring import IMAGES_PER_READ, read_in_parts

    if len(files) == 1 and Path(files[0]).is_dir():
        folder_classes, listed = image_folder_files(files[0])
        items = [
            {"path": str(f), "folder_class": c, "file": 0, "row": row} for row, (c, _, f) in enumerate(listed)
        ]
        labels = {
            "folder_classes": folder_classes,
            "classes": read["classes"],
            "num_labels": read["num_labels"],
        }
        return read_in_parts(items, _read_labelled_images, IMAGES_PER_READ, labels)
    items = [{"path": str(f), "file": number} for number, f in enumerate(files)]
    return read_in_parts(items, _read_labelled, 1, read)


class _Featurizer(ModelWorker):
    """One worker: each batch's members' features (and every layer's tokens where asked), as
    computed (float32 holds every precision's values exactly)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..data import model_batches
        from ..evaluation.predict import predict

        s, labels = self.settings, [int(label) for label in batch["label"]]
        dataset = self.dataset(batch, [str(i) for i in range(len(labels))], labels, list(s["classes"]))
        _, batches = model_batches(
            dataset,
            self.model,
            self.preprocessor,
            s["batch_size"],
            s["max_length"],
            True,
            "the training data",
        )
        preds = predict(
            self.model, batches, "features", progress=False, precision=s["precision"], layers=s["layers"]
        )
        if preds.member_features is None:
            raise InputError("the model's logits are not one affine map of one feature vector per member")
        out = {key: batch[key] for key in ("label", "file", "row")}
        out["features"] = np.asarray(preds.member_features, np.float32).transpose(1, 0, 2)  # (B, M, D)
        if s["layers"]:
            out["layers"] = np.asarray(preds.layer_features, np.float32).transpose(
                1, 0, 2, 3
            )  # (B, M, L, D_h)
        return out


def _counts(batch: dict[str, np.ndarray], files: int, classes: int) -> dict[str, np.ndarray]:
    """A block's rows per file and per class."""
    return {
        "files": np.bincount(batch["file"], minlength=files)[None],
        "classes": np.bincount(batch["label"], minlength=classes)[None],
    }


def _summarise(
    batch: dict[str, np.ndarray], summarise: Callable, offsets: np.ndarray
) -> dict[str, np.ndarray]:
    """One block's summaries by every score (`ood.passes.summarise_block`), as one row holding them
    in NumPy's own format (no pickle): ``SCORE/KEY`` -> array."""
    from ..ood.registry import Block

    features = np.asarray(batch["features"], np.float64).transpose(1, 0, 2)
    layers = np.asarray(batch["layers"], np.float64).transpose(1, 0, 2, 3) if "layers" in batch else None
    index = offsets[batch["file"]] + batch["row"]
    summaries = summarise(Block(features, np.asarray(batch["label"], np.int64), index, layers))
    arrays = {f"{name}/{key}": value for name, part in summaries.items() for key, value in part.items()}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return {"summary": np.asarray([buffer.getvalue()], dtype=object)}


def _summaries(row: dict[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    """`_summarise`'s row read back: score -> its summary (empty for a score that summarised none)."""
    out: dict[str, dict[str, np.ndarray]] = collections.defaultdict(dict)
    with np.load(io.BytesIO(row["summary"]), allow_pickle=False) as arrays:
        for key in arrays.files:
            name, _, part = key.partition("/")
            out[name][part] = arrays[key]
    return out


def fit_statistics_dataset(
    model: str,
    files: Sequence[str | os.PathLike],
    plan: RayPlan,
    *,
    classes: Sequence[str] | None,
    num_labels: int,
    heads: tuple[Any, Any] | None = None,
    scores: Sequence[str] | None = None,
    batch_size: int = 32,
    max_length: int = 128,
    precision: str = "auto",
    text_column: str | None = None,
    label_column: str | None = None,
    preprocessor: str | None = None,
) -> Any:
    """The `FeatureStatistics` of the saved ``model`` over the labelled rows of ``files``
    (`scoring.data_files`), computed on ``plan``'s workers: ``scores`` (default: every registered
    score fit in passes) as `FeatureStatistics.fit` fits them on the same rows in the order of the
    files; ``heads``: the members' output layers (`ood.features.ensemble_heads`), which ViM reads
    (without them it is not fit). The class names ``classes`` (the model's; None: class ids)
    number the files' labels as `predict` does."""
    from ..ood import FeatureStatistics
    from ..ood.registry import feature_score, feature_scores, reads_layers

    scores = (
        tuple(n for n in feature_scores() if feature_score(n).passes) if scores is None else tuple(scores)
    )
    settings = {
        "classes": list(classes) if classes else [str(c) for c in range(num_labels)],
        "batch_size": batch_size,
        "max_length": max_length,
        "precision": precision,
        "threads": plan.threads,
        "preprocessor": preprocessor,
        "layers": any(reads_layers(name) for name in scores),
    }
    read = {"columns": (text_column, label_column), "classes": classes, "num_labels": num_labels}
    features = _features(str(model), files, plan, settings, read)
    shape, class_counts, layer_shape, offsets = _layout(features, len(files), num_labels)

    def map_blocks(summarise: Callable) -> list[dict]:
        fn_kwargs = {"summarise": summarise, "offsets": offsets}
        summaries = features.map_batches(_summarise, fn_kwargs=fn_kwargs, batch_size=None, num_cpus=READ_CPUS)
        return [_summaries(row) for row in summaries.take_all()]

    return FeatureStatistics.fit_blocks(map_blocks, shape, class_counts, heads, layer_shape, scores=scores)


def _features(model: str, files: Sequence, plan: RayPlan, settings: dict, read: dict) -> Any:
    """The labelled rows of ``files`` (`_labelled_rows`, with ``read``) with their features
    computed by ``plan``'s workers, each holding ``model`` (`_Featurizer`), materialised in Ray's
    object store."""
    ray = require_ray()
    return (
        _labelled_rows(files, read)
        .map_batches(
            _Featurizer,
            fn_constructor_args=(model, settings),
            batch_size=settings["batch_size"],
            compute=ray.data.ActorPoolStrategy(size=plan.workers),
            num_cpus=1,
            batch_format="numpy",
        )
        .materialize()
    )


def _layout(features: Any, files: int, classes: int) -> tuple:
    """Of the featurised rows: (members, rows, width), the rows per class, the layer tokens'
    (layers, width) or None, and each file's first row's place among all rows."""
    counts = features.map_batches(
        _counts, fn_kwargs={"files": files, "classes": classes}, batch_size=None, num_cpus=READ_CPUS
    ).take_all()
    per_file = np.sum([c["files"] for c in counts], 0) if counts else np.zeros(files, np.int64)
    if per_file.sum() < 2:
        raise InputError(f"feature statistics need two training rows or more, got {int(per_file.sum())}")
    first = features.take(1)[0]
    members, width = first["features"].shape
    layer_shape = first["layers"].shape[1:] if "layers" in first else None
    offsets = np.concatenate([[0], np.cumsum(per_file)[:-1]]).astype(np.int64)
    class_counts = np.sum([c["classes"] for c in counts], 0)
    return (members, int(per_file.sum()), width), class_counts, layer_shape, offsets
