"""``hydra-ens calibrate``: fit a saved model's calibration again (temperature, feature statistics,
flag score and threshold, prediction sets) on new validation data, without training anything,
and save the model with it as a new folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra_ensembles.errors import InputError

from .command import Command
from .common import _calibrate, _data_batches, _load_methods, _say_precision
from .options import (
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _overwrite_option,
    calibration_config,
)
from .predict_ray import engine_options, statistics_on_ray

SAVED_KINDS = ("fused", "member", "ensemble")
"""The library's saved formats `calibrate` writes again (beside Hugging Face classifier folders)."""


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from hydra_ensembles.loading import load_preprocessor
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
    _say_precision(args)
    _calibrate(model, val, args, args.val_data, train=train, ood=ood, **_statistics(args, model, ray, train))
    atomic_dir(out, lambda folder: _write(model, found, folder, preprocessor), marker=True)
    print(f"saved the model with its new calibration to {out}")
    return 0


def _statistics(args: argparse.Namespace, model, ray: bool, train) -> dict:
    """The feature statistics `fit_calibration` is given, with the record of their data: fit on
    Ray over --data; none where --data is fit in this process; else the saved ones, as saved."""
    from hydra_ensembles.calibration import saved_calibration

    if ray:
        fitted = statistics_on_ray(args, model, args.model)
        return dict(zip(("statistics", "statistics_data"), fitted, strict=True))
    saved = saved_calibration(model)
    if train is not None or saved is None or saved.flag.statistics is None:
        return {}
    return {"statistics": saved.flag.statistics, "statistics_data": saved.provenance.statistics}


def _check_ray_calibration(args: argparse.Namespace, config) -> bool:
    """Whether the feature statistics are fit on Ray (``--engine ray``); InputError, before any
    work, where they cannot be: no --data, or a flag score Ray does not fit."""
    from hydra_ensembles.ood import feature_scores
    from hydra_ensembles.ood.registry import feature_score

    if args.engine != "ray":
        return False
    if not args.data:
        raise InputError(
            "--engine ray fits the feature statistics on --data: give the labelled training data"
        )
    if config.score in feature_scores() and not feature_score(config.score).passes:
        raise InputError(
            f"--engine ray fits the scores fit in passes over blocks of rows; {config.score} is fit in one "
            "process only (calibrate without --engine ray)"
        )
    return True


def _calibration_data(args: argparse.Namespace, preprocessor, model, config, train: bool = True) -> tuple:
    """The labelled ID validation batches (checked against what the calibration needs), and the labelled
    training (where ``train``) and unlabelled OOD validation batches where given (else None)."""
    from hydra_ensembles.calibration.calibration import check_calibration_data

    val = _data_batches(args.val_data, args, preprocessor, model=model)[1]
    check_calibration_data(val, config, model)
    train = _data_batches(args.data, args, preprocessor, model=model)[1] if args.data and train else None
    ood = (
        _data_batches(args.ood_data, args, preprocessor, labels=False, model=model)[1]
        if args.ood_data
        else None
    )
    return val, train, ood


def _write(model, found, folder: Path, preprocessor) -> None:
    """``model`` in the format it was read in (``found``; a Hugging Face classifier folder where no
    registered format claims it), its preprocessor beside it."""
    from hydra_ensembles.build import save_with_preprocessor
    from hydra_ensembles.members.storage import CLASSIFIER

    save_with_preprocessor(model, folder, preprocessor, found or CLASSIFIER)


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
    engine_options(cal, "the feature statistics fit on --data")


COMMAND = Command(
    "calibrate",
    help="fit a saved model's calibration again on new data (temperature, statistics, flag, sets) "
    "without training; saved with the model to a new folder",
    add_arguments=_add_calibrate_arguments,
    run=_cmd_calibrate,
)
