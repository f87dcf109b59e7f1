"""``hydra-ens predict --engine ray``: the records of `predict`, scored on Ray Data workers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from hydra_ensembles.errors import InputError

from .clock import STARTED
from .guards import check_output_dir
from .options import POSITIVE


def engine_options(parser: argparse.ArgumentParser, work: str = "the scoring") -> None:
    """A command's options of the engine that does ``work``: this process, or Ray."""
    parser.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help=f"where {work} runs. local (default): this process; ray: Ray Data workers, on Ray embedded "
        "on this machine or, with --address, on a Ray cluster (needs the ray extra; docs/scaling.md)",
    )
    parser.add_argument(
        "--address",
        help="with --engine ray: the Ray cluster to run on (auto, or ray://HOST:PORT); default: Ray "
        "embedded on this machine for the job",
    )
    parser.add_argument(
        "--workers",
        type=POSITIVE,
        help="with --engine ray: workers, one CPU each (default: as many as the machine or cluster "
        "holds while each node keeps half a CPU for reading and writing)",
    )


def statistics_on_ray(args: argparse.Namespace, model, path: str) -> tuple:
    """The feature statistics of ``model`` (saved at ``path``, which every Ray node reads) fit over
    ``--data`` on Ray (every score fit in passes), and the record of that data: its name and the
    SHA-256 of its files' SHA-256s in the order of their names (an image folder's images, each
    with its id)."""
    from hydra_ensembles.calibration.provenance import DataRecord
    from hydra_ensembles.distributed import data_files
    from hydra_ensembles.hashing import text_digest

    files = data_files(args.data)
    try:
        statistics = _fit_on_ray(args, model, path, files)
    except Exception as exc:
        raise _user_error(exc) from None
    return statistics, DataRecord(args.data, text_digest("".join(_digests(files))))


def _fit_on_ray(args: argparse.Namespace, model, path: str, files: list) -> Any:
    """`statistics_on_ray`'s fit, in a Ray session of its own."""
    from hydra_ensembles.data.labels import model_class_names, num_model_labels
    from hydra_ensembles.distributed import ray_session
    from hydra_ensembles.distributed.statistics import fit_statistics_dataset
    from hydra_ensembles.members.ensemble import as_ensemble
    from hydra_ensembles.ood.features import ensemble_heads

    from .common import _resolve_length

    with ray_session(args.address, args.workers) as plan:
        print(f"fitting the feature statistics on {len(files)} file(s) with {plan.describe()}")
        return fit_statistics_dataset(
            path, files, plan, classes=model_class_names(model), num_labels=num_model_labels(model),
            heads=ensemble_heads(as_ensemble(model)), batch_size=args.batch_size,
            max_length=_resolve_length(args, model),
            precision=getattr(args, "precision_asked", args.precision),
            text_column=args.text_column, label_column=args.label_column, preprocessor=args.preprocessor,
        )  # fmt: skip


def _digests(files: list) -> list[str]:
    """The SHA-256 of each file, in order; an image folder's: each image's id and SHA-256."""
    from hydra_ensembles.data.images import image_folder_files
    from hydra_ensembles.hashing import sha256_file

    if len(files) == 1 and files[0].is_dir():
        return [image_id + sha256_file(file) for _, image_id, file in image_folder_files(files[0])[1]]
    return [sha256_file(f) for f in files]


def check_ray_options(args: argparse.Namespace) -> Path:
    """The output folder, checked with the other options before any work (Ray installed, the
    data's files found); InputError for what the Ray engine does not take."""
    from hydra_ensembles.distributed import data_files, require_ray

    require_ray()
    if args.plot:
        raise InputError("--plot draws from one process's scores: run predict without --engine ray")
    if args.labelled:
        raise InputError("--labelled with --engine ray is not supported: run predict without --engine")
    if args.allow_random_head:
        raise InputError(
            "--allow-random-head with --engine ray: each worker would draw its own random head; save the "
            "model with its head first (finetune)"
        )
    if "," in args.model:
        raise InputError("--engine ray scores one saved model: build or fuse the ensemble into one folder")
    out = Path(args.out)
    if out.suffix in (".csv", ".jsonl"):
        raise InputError(f"with --engine ray, --out is a folder of Parquet files, not a {out.suffix} file")
    data_files(args.data)
    return check_output_dir(out, replaced=True)


def predict_on_ray(args: argparse.Namespace, out: Path, calibration, flag_score: str, classes) -> int:
    """Score ``--data`` on Ray with ``calibration`` and write the records' folder ``out``."""
    from hydra_ensembles.distributed import (
        data_files,
        predict_dataset,
        ray_session,
        screen_dataset,
        write_predictions,
    )
    from hydra_ensembles.saving.files import remove_stale_temps

    files = data_files(args.data)
    precision = getattr(args, "precision_asked", args.precision)
    if remove_stale_temps(out):
        print(
            f"an interrupted run's staged records beside {out} were removed: Ray Data names its output "
            "files by task, not by input rows, so no block can be matched to the rows it holds, and the "
            "job scores every row again"
        )
    started = time.perf_counter()
    try:
        with ray_session(args.address, args.workers) as plan:
            print(f"scoring {len(files)} file(s) with {plan.describe()}")
            records = predict_dataset(
                args.model,
                files,
                plan,
                calibration=calibration,
                classes=classes,
                batch_size=args.batch_size,
                max_length=args.max_length,
                precision=precision,
                flag_score=flag_score,
                text_column=args.text_column,
                preprocessor=args.preprocessor,
            )
            cutoff = None
            if args.fdr is not None:
                records, cutoff = screen_dataset(records.materialize(), args.fdr)
            settings = {
                "model": str(args.model),
                "data": [str(f) for f in files],
                "batch_size": args.batch_size,
                "max_length": args.max_length,
                "precision": precision,
                "flag_score": flag_score,  # the calibration's where there is one (`_flag_score`)
                "fdr": args.fdr,
            }
            manifest = write_predictions(records, out, settings)
    except Exception as exc:
        raise _user_error(exc) from None
    print("\n".join(_summary(out, manifest, cutoff, args, time.perf_counter() - started)))
    return 0


def _user_error(exc: BaseException) -> BaseException:
    """The library's own InputError raised on a worker (a row ``predict`` refuses), as its one
    line: Ray re-raises it wrapped, with the worker's traceback as text; any other error as it is."""
    import re

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, InputError) and "Ray" not in type(seen).__name__:  # not Ray's wrapped copy
            return InputError(str(seen))
        cause = getattr(seen, "cause", None)
        seen = cause if isinstance(cause, BaseException) and cause is not seen else seen.__cause__
    found = re.findall(r"^hydra_ensembles\.errors\.\w+: (.+)$", str(exc), flags=re.M)
    return InputError(found[-1]) if found else exc


def _summary(out: Path, manifest: dict, cutoff, args: argparse.Namespace, seconds: float) -> list[str]:
    """Rows written, the share flagged (and how), the time."""
    flagged = manifest.get("flagged")
    lines = [f"{manifest['rows']} predictions in {len(manifest['files'])} Parquet file(s) -> {out}"]
    if flagged is not None:
        how = (
            f"Benjamini-Hochberg over all {manifest['rows']} rows at false discovery rate {args.fdr:g}, "
            f"p-value <= {cutoff:.4g}"
            if cutoff is not None
            else "the calibration's per-input flag"
        )
        lines.append(f"flagged ({how}): {flagged} ({flagged / manifest['rows']:.1%})")
    total = time.perf_counter() - STARTED
    lines.append(f"the Ray job took {seconds:.2f} s of the command's {total:.2f} s (imports included)")
    return lines
