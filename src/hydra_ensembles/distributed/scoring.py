"""Score a dataset on Ray Data with the records ``hydra-ens predict`` writes.

The data's files are read one per task by the library's own readers (the ids, the text column's
checks and an empty text's refusal are `predict`'s); a pool of actors (`cluster.RayPlan`), each
holding the model loaded once, turns batches of rows into `predict_records`' records; the
false-discovery-rate screening is decided over every row (`screen_dataset`); the records are
written as Parquet files into a staging folder that becomes the output only once complete, with a
manifest (`write_predictions`)."""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .cluster import READ_CPUS, RayPlan, require_ray

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
"""The files a Ray job reads: the text tables `predict` reads, and Parquet."""
PREDICTIONS_MANIFEST = "manifest.json"
"""The file of a predictions folder that names its Parquet files, rows and settings."""
RECORDS_FOLDER = "records"
JSON_COLUMNS = ("prediction_set",)
"""The records' nested values, held in Parquet as JSON text so that no block's schema depends on
its rows' values (an empty set in every row of a block)."""

__all__ = [
    "PREDICTIONS_MANIFEST",
    "TABLE_SUFFIXES",
    "data_files",
    "predict_dataset",
    "read_predictions",
    "screen_dataset",
    "write_predictions",
]


IMAGES_PER_READ = 64
"""Images one read task decodes (an image folder is read in parts of this many files)."""


def data_files(spec: str) -> list[Path]:
    """The files ``spec`` names: a file, or a glob pattern (``'corpus/*.parquet'``), sorted; or an
    image folder (``<class>/<image>``), as a list of itself. InputError where it names none, a
    file of another kind, or two files of one name (whose ids, ``NAME/ROW``, would collide)."""
    from ..data.images import image_folder_files

    if not glob.has_magic(spec) and Path(spec).is_dir():
        image_folder_files(spec)  # checked before any work, as predict reads it
        return [Path(spec)]
    matches = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    files = [Path(m) for m in matches if Path(m).is_file()]
    if not files:
        raise InputError(f"--data {spec!r} names no file (a file, or a pattern such as 'corpus/*.parquet')")
    other = [f for f in files if f.suffix not in TABLE_SUFFIXES]
    if other:
        raise InputError(
            f"{other[0]}: --engine ray reads {', '.join(TABLE_SUFFIXES)} files and image folders"
        )
    names = [f.name for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(
            f"two files are named {twice[0]}: their rows' ids (NAME/ROW) would collide; rename one"
        )
    return files


def _read_files(batch: dict[str, np.ndarray], text_column: str | None) -> dict[str, list[str]]:
    """The rows of the files in ``batch["path"]``, read as `predict` reads them."""
    from ..data import load_spec

    ids, texts = [], []
    for path in batch["path"]:
        dataset = load_spec(str(path), text_column, None, labelled=False)
        if not hasattr(dataset, "texts"):
            raise InputError(f"{path} holds no texts; --engine ray scores text tables")
        ids += dataset.ids
        texts += dataset.texts
    return {"id": ids, "text": texts}


def _read_images(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """The images of ``batch["path"]`` as `predict` reads an image folder's, with their ids."""
    from ..data.images import read_image, stack_images

    images = [read_image(str(path)) for path in batch["path"]]
    return {"id": list(batch["id"]), "image": stack_images(images, "the image folder")}


def _rows(files: Sequence[str | os.PathLike], text_column: str | None) -> Any:
    """The rows of ``files`` (`data_files`) as a Ray dataset: a table per read task, or an image
    folder's images `IMAGES_PER_READ` per read task; ``id`` first, then ``text`` or ``image``."""
    if len(files) == 1 and Path(files[0]).is_dir():
        from ..data.images import image_folder_files

        items = [{"path": str(f), "id": i} for _, i, f in image_folder_files(files[0])[1]]
        return read_in_parts(items, _read_images, IMAGES_PER_READ)
    items = [{"path": str(f)} for f in files]
    return read_in_parts(items, _read_files, 1, {"text_column": text_column})


def read_in_parts(items: list[dict], read: Any, per_task: int, fn_kwargs: dict | None = None) -> Any:
    """``items`` as a Ray dataset mapped by ``read``, ``per_task`` of them in each read task."""
    ray = require_ray()
    parts = ray.data.from_items(items, override_num_blocks=-(-len(items) // per_task))
    return parts.map_batches(read, batch_size=per_task, fn_kwargs=fn_kwargs or {}, num_cpus=READ_CPUS)


class ModelWorker:
    """A Ray worker that holds the saved ``model`` and its preprocessor (``settings["preprocessor"]``
    or the model's own), loaded once, and computes with ``settings["threads"]`` threads; a
    subclass's ``__call__`` maps one batch of rows."""

    def __init__(self, model: str, settings: dict[str, Any]) -> None:
        import torch

        from ..loading import load_any, load_preprocessor

        torch.set_num_threads(settings["threads"])
        self.model = load_any(model).eval()
        self.preprocessor = load_preprocessor(settings["preprocessor"] or model)
        self.settings = settings

    @staticmethod
    def dataset(batch: dict[str, np.ndarray], ids: list[str], labels: list[int], classes: list[str]) -> Any:
        """A batch of rows (``image`` or ``text``) as the dataset `data.model_batches` takes."""
        from ..data.images import ImageDataset
        from ..data.text import TextDataset

        if "image" in batch:
            return ImageDataset(np.stack(list(batch["image"])).astype(np.float32), labels, ids, classes)
        return TextDataset([str(t) for t in batch["text"]], labels, ids, classes)


class _Scorer(ModelWorker):
    """One scoring worker: records for each batch of rows."""

    def __call__(self, batch: dict[str, np.ndarray]) -> Any:
        import pyarrow as pa

        from ..data import model_batches
        from ..evaluation.uncertainty import predict_records

        s = self.settings
        ids = [str(i) for i in batch["id"]]
        dataset = self.dataset(batch, ids, [0] * len(ids), [])
        _, batches = model_batches(
            dataset, self.model, self.preprocessor, s["batch_size"], s["max_length"], False, "the data"
        )
        _, rows, _ = predict_records(
            self.model,
            dataset,
            batches,
            s["calibration"],
            s["classes"],
            precision=s["precision"],
            flag_score=s["flag_score"],
            progress=False,
        )
        return pa.Table.from_pylist([_flat(row) for row in rows])


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A record as Parquet holds it alike in every block (`JSON_COLUMNS`)."""
    return {k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in row.items()}


def predict_dataset(
    model: str,
    files: Sequence[str | os.PathLike],
    plan: RayPlan,
    *,
    calibration: Any = None,
    classes: Sequence[str] | None = None,
    batch_size: int = 32,
    max_length: int = 128,
    precision: str = "auto",
    flag_score: str = "msp",
    text_column: str | None = None,
    preprocessor: str | None = None,
) -> Any:
    """The records of every row of ``files`` (`data_files`) scored by the saved ``model`` (a
    folder every node can read) on ``plan``'s workers, as a ``ray.data.Dataset``, lazily (one
    row per input row, ``id`` first), its inputs made by ``preprocessor`` (a folder or hub id; default: the
    model's own). ``calibration``: the calibration to record (else per-input
    records flagged on ``flag_score``). Each worker resolves ``precision`` on its own node. A
    record equals `predict`'s for the same row computed in one batch with the same others."""
    rows = _rows(files, text_column)
    settings = {
        "calibration": calibration,
        "classes": list(classes) if classes else None,
        "batch_size": batch_size,
        "max_length": max_length,
        "precision": precision,
        "flag_score": flag_score,
        "threads": plan.threads,
        "preprocessor": preprocessor,
    }
    with warnings.catch_warnings():  # Ray names no other way to restart the workers that die
        warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
        return _scored(rows, model, settings, plan)


def _scored(rows: Any, model: str | os.PathLike, settings: dict[str, Any], plan: RayPlan) -> Any:
    """``rows`` mapped by a pool of ``plan.workers`` `_Scorer` actors, restarted when they die."""
    ray = require_ray()
    return rows.map_batches(
        _Scorer,
        fn_constructor_args=(str(model), settings),
        batch_size=settings["batch_size"],
        compute=ray.data.ActorPoolStrategy(size=plan.workers),
        num_cpus=1,
        batch_format="numpy",
        max_restarts=-1,
        max_task_retries=-1,
    )


def _value_counts(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A block's distinct p-values and how many rows hold each."""
    values, counts = np.unique(np.asarray(batch["ood_p_value"], dtype=np.float64), return_counts=True)
    return {"value": values, "count": counts}


def screen_dataset(records: Any, level: float) -> tuple[Any, float]:
    """``records`` (with ``ood_p_value``) with ``flagged`` replaced by the Benjamini-Hochberg
    selection at false discovery rate ``level`` over every row (`conformal.benjamini_hochberg`,
    exactly: decided from one count per distinct p-value), and the p-value cutoff (-inf: none)."""
    from ..evaluation.conformal import benjamini_hochberg_cutoff

    if "ood_p_value" not in records.columns():
        raise InputError("--fdr selects by conformal p-values: it needs a conformal calibration")
    counted: dict[float, int] = {}
    for row in (
        records.select_columns(["ood_p_value"]).map_batches(_value_counts, num_cpus=READ_CPUS).take_all()
    ):
        counted[float(row["value"])] = counted.get(float(row["value"]), 0) + int(row["count"])
    cutoff = benjamini_hochberg_cutoff(list(counted), list(counted.values()), level)

    def select(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**batch, "flagged": np.asarray(batch["ood_p_value"], dtype=np.float64) <= cutoff}

    return records.map_batches(select, batch_format="numpy", num_cpus=READ_CPUS), cutoff


def write_predictions(records: Any, out: str | os.PathLike, settings: dict[str, Any]) -> dict[str, Any]:
    """Write ``records`` into the folder ``out`` as Parquet files (``records/``) with a manifest
    naming each file and its rows, the total and ``settings``: staged beside ``out`` and moved
    into place complete (`saving.files.atomic_dir`), so an interrupted job leaves no output that
    looks complete. Returns the manifest."""
    import pyarrow.parquet as pq

    from ..saving.files import atomic_dir

    manifest: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():  # Ray names no other way to size the write tasks
            warnings.filterwarnings("ignore", "`ray_remote_args` is deprecated")
            records.write_parquet(str(tmp / RECORDS_FOLDER), ray_remote_args={"num_cpus": READ_CPUS})
        files = sorted((tmp / RECORDS_FOLDER).glob("*.parquet"))
        counts = {f"{RECORDS_FOLDER}/{f.name}": pq.ParquetFile(f).metadata.num_rows for f in files}
        manifest.update({"files": counts, "rows": sum(counts.values()), "settings": settings})
        if files and "flagged" in pq.read_schema(files[0]).names:
            manifest["flagged"] = sum(
                int(pq.read_table(f, columns=["flagged"])["flagged"].to_numpy().sum()) for f in files
            )
        (tmp / PREDICTIONS_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))

    atomic_dir(out, write, marker=True)
    return manifest


def read_predictions(out: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a predictions folder (`write_predictions`), nested values decoded, in the
    order of their ids' files and rows (an image folder's: classes and file names, as `predict`);
    InputError where the manifest names a file outside ``records/`` or one that is missing, or a
    file holds another number of rows. Nothing is read through a link (`saving.files.check_own_tree`)."""
    import pyarrow.parquet as pq

    from ..saving.files import check_own_tree, read_json

    folder = check_own_tree(out)
    manifest = read_json(folder / PREDICTIONS_MANIFEST, "predictions manifest")
    rows: list[dict[str, Any]] = []
    for name, count in manifest["files"].items():
        part = Path(name)
        if part.parent != Path(RECORDS_FOLDER) or part.suffix != ".parquet" or part.name.startswith("."):
            raise InputError(
                f"{folder / PREDICTIONS_MANIFEST} names {name!r}, not a file of {RECORDS_FOLDER}/"
            )
        if not (folder / part).is_file():
            raise InputError(f"{folder / part} is missing: the predictions folder is incomplete")
        table = pq.read_table(folder / part)
        if table.num_rows != count:
            raise InputError(f"{folder / name} holds {table.num_rows} rows; the manifest says {count}")
        rows += table.to_pylist()
    for row in rows:
        for key in JSON_COLUMNS:
            if key in row:
                row[key] = json.loads(row[key])
    numbered = all(row["id"].rpartition("/")[2].isdigit() for row in rows)  # FILE/ROW; else CLASS/IMAGE

    def order(row: dict[str, Any]) -> tuple:
        source, _, place = row["id"].rpartition("/")
        return (source, int(place)) if numbered else (source, place)

    return sorted(rows, key=order)
