"""``hydra-ens calibrate``: fit a saved model's calibration again (temperature, feature statistics,
flag score and threshold, prediction sets) on new validation data, without training anything,
and save the model with it as a new folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra_ensembles.errors import InputError

from .command import Command
from .common import _data_batches, _load_methods, _say_precision, _write_classifier
from .options import (
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _overwrite_option,
    calibration_config,
)
from .predict_ray import engine_options

SAVED_KINDS = ("fused", "member", "ensemble")
"""The library's saved formats `calibrate` writes again (beside Hugging Face classifier folders)."""


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from hydra_ensembles.evaluation import predict
    from hydra_ensembles.evaluation.calibration import Calibration, validation_aurocs
    from hydra_ensembles.evaluation.model_calibration import (
        record_calibration,
        saved_calibration,
    )
    from hydra_ensembles.hashing import batches_digest
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.precision import model_device, resolve_precision
    from hydra_ensembles.saving.files import atomic_dir
    from hydra_ensembles.saving.formats import saved_format

    from .guards import check_output_dir

    out = check_output_dir(args.out, finished="config.json", overwrite=args.overwrite, replaced=True)
    found = saved_format(args.model)
    if found is not None and found.kind not in SAVED_KINDS:
        raise InputError(f"{args.model} is a saved {found.kind}: calibrate writes {', '.join(SAVED_KINDS)} "
                         "folders and Hugging Face classifiers")  # fmt: skip
    models, preprocessor = _load_methods(args.model, args)
    if len(models) != 1:
        raise InputError("calibrate takes one saved model (an explicit ensemble has no folder to save)")
    model = models[0]
    if args.preprocessor:
        preprocessor = load_preprocessor(args.preprocessor)
    config = calibration_config(args)
    ray = _check_ray_calibration(args, config)
    val, train, ood = _calibration_data(args, preprocessor, model, config, train=not ray)
    saved = saved_calibration(model)
    _say_precision(args)
    statistics, kept, train_sha256 = _statistics(args, model, saved, train, ray)
    layers = statistics is not None and statistics.reads_layers
    val_predictions = predict(model, val, "calibration", precision=args.precision, layers=layers)
    ood_predictions = (
        predict(model, ood, "OOD validation", precision=args.precision, layers=layers) if ood else None
    )
    fitted = Calibration.fit(
        val_predictions, config, data=args.val_data, data_sha256=batches_digest(val),
        precision=resolve_precision(args.precision, model_device(model)).name, statistics=statistics,
        statistics_data=saved.statistics_data if kept else (args.data or ""),
        statistics_data_sha256=train_sha256,
        ood_validation=ood_predictions, ood_data=args.ood_data or "",
        ood_data_sha256=batches_digest(ood) if ood else "",
    )  # fmt: skip
    if ood_predictions is not None:
        _print_aurocs(
            validation_aurocs(val_predictions, ood_predictions, statistics, fitted.temperature), fitted
        )
    calibration = record_calibration(model, fitted)
    atomic_dir(out, lambda folder: _write(model, found, folder, preprocessor), marker=True)
    print(f"calibration: {calibration.describe()}")
    print(f"saved the model with its new calibration to {out}")
    return 0


def _statistics(args: argparse.Namespace, model, saved, train, ray: bool) -> tuple:
    """The feature statistics (fit on ``train``'s batches, or on Ray over --data, else the saved
    ones), whether they are the saved ones, and the SHA-256 of the data they were fit on."""
    from hydra_ensembles.evaluation.model_calibration import fit_statistics
    from hydra_ensembles.hashing import batches_digest

    if ray:
        statistics, digest = _statistics_on_ray(args, model)
        return statistics, False, digest
    if train is not None:
        return fit_statistics(model, train, precision=args.precision), False, batches_digest(train)
    statistics = saved.statistics if saved is not None else None
    kept = statistics is not None  # the saved statistics, named as saved
    return statistics, kept, saved.statistics_data_sha256 if kept else ""


def _check_ray_calibration(args: argparse.Namespace, config) -> bool:
    """Whether the feature statistics are fit on Ray (``--engine ray``); InputError, before any
    work, where they cannot be: no --data, or a flag score Ray does not fit."""
    from hydra_ensembles.ood import feature_scores
    from hydra_ensembles.ood.moments import MERGEABLE_SCORES

    if args.engine != "ray":
        return False
    if not args.data:
        raise InputError(
            "--engine ray fits the feature statistics on --data: give the labelled training data"
        )
    if config.score in feature_scores() and config.score not in MERGEABLE_SCORES:
        fitted = ", ".join(MERGEABLE_SCORES)
        raise InputError(
            f"--engine ray fits the feature statistics of {fitted}; {config.score} is fit in one process "
            "(calibrate without --engine ray)"
        )
    return True


def _statistics_on_ray(args: argparse.Namespace, model) -> tuple:
    """The feature statistics fit over ``--data`` on Ray, and the SHA-256 of its files' bytes in
    the order of their names (what the calibration records of the data)."""
    from hydra_ensembles.data.labels import model_class_names, num_model_labels
    from hydra_ensembles.distributed import data_files, ray_session
    from hydra_ensembles.distributed.statistics import fit_statistics_dataset
    from hydra_ensembles.hashing import sha256_file, text_digest

    from .common import _resolve_length

    files = data_files(args.data)
    with ray_session(args.address, args.workers) as plan:
        print(f"fitting the feature statistics on {len(files)} file(s) with {plan.describe()}")
        statistics = fit_statistics_dataset(
            args.model, files, plan, classes=model_class_names(model), num_labels=num_model_labels(model),
            batch_size=args.batch_size, max_length=_resolve_length(args, model),
            precision=getattr(args, "precision_asked", args.precision), text_column=args.text_column,
            label_column=args.label_column, preprocessor=args.preprocessor,
        )  # fmt: skip
    digest = text_digest("".join(sha256_file(f) for f in files))
    return statistics, digest


def _calibration_data(args: argparse.Namespace, preprocessor, model, config, train: bool = True) -> tuple:
    """The labelled ID validation batches (checked against what the calibration needs), and the labelled
    training (where ``train``) and unlabelled OOD validation batches where given (else None)."""
    from hydra_ensembles.evaluation.calibration import check_calibration_data

    val = _data_batches(args.val_data, args, preprocessor, model=model)[1]
    check_calibration_data(val, config, model)
    train = _data_batches(args.data, args, preprocessor, model=model)[1] if args.data and train else None
    ood = (
        _data_batches(args.ood_data, args, preprocessor, labels=False, model=model)[1]
        if args.ood_data
        else None
    )
    return val, train, ood


def _print_aurocs(aurocs: dict[str, float], fitted) -> None:
    """Every candidate score's validation AUROC, best first, the flag score and inverted ones named."""
    print("validation AUROC of each score, ID validation against OOD validation (higher separates better):")
    for score, auroc in sorted(aurocs.items(), key=lambda item: -item[1]):
        note = "  <- the flag score" if score == fitted.score else ""
        note = note or ("  (inverted: ranks the OOD data as more in-distribution)" if auroc < 0.5 else "")
        print(f"  {score:<20} {100 * auroc:6.2f}{note}")


def _write(model, found, folder: Path, preprocessor) -> None:
    """``model`` in the format it was read in: the library's own (a fused model, a member, an
    ensemble of members: each writes its statistics and checksums), or a Hugging Face classifier
    folder as ``finetune`` writes it (weights, config, statistics, preprocessor, checksums last)."""
    from hydra_ensembles.build import save_preprocessor
    from hydra_ensembles.members import save_member

    if found is None:  # a Hugging Face classifier
        _write_classifier(model, folder, preprocessor)
        return
    save_preprocessor(preprocessor, folder)  # first: the model's checksums then cover it
    if found.kind == "member":
        save_member(model, folder)
    else:
        model.save_pretrained(folder)


def _add_calibrate_arguments(cal: argparse.ArgumentParser) -> None:
    cal.add_argument("model", help="a saved Hydra model, member or ensemble (build's hydra/, members/), or "
                     "a Hugging Face classifier folder (finetune's output)")  # fmt: skip
    cal.add_argument(
        "--val-data", required=True, help="labelled ID validation data the calibration is fit on"
    )
    cal.add_argument(
        "--data",
        help="labelled ID training data: fit the feature statistics on it (default: keep the saved ones)",
    )
    _calibration_options(cal, "--val-data")
    cal.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    cal.add_argument("--out", required=True, help="the output folder: the model with its new calibration")
    _overwrite_option(cal)
    _data_options(cal)
    engine_options(cal, "the feature statistics fit on --data (mds, rmds, mds++)")


COMMAND = Command(
    "calibrate",
    help="fit a saved model's calibration again on new data (temperature, statistics, flag, sets) "
    "without training; saved with the model to a new folder",
    add_arguments=_add_calibrate_arguments,
    run=_cmd_calibrate,
)
