"""``hydra-ens predict``: per-input predictions with uncertainty and an OOD flag."""

from __future__ import annotations

import argparse
import sys
import time

from hydra_ensembles.errors import InputError

from .clock import STARTED
from .command import Command
from .common import _data_batches, _load_methods, _resolve_length, _say_precision
from .options import (
    PREPROCESSOR_HELP,
    REGISTERED_SCORES,
    _data_options,
    _fraction,
    _random_head_option,
    ood_score,
)
from .predict_ray import check_ray_options, engine_options


def _cmd_predict(args: argparse.Namespace) -> int:
    from hydra_ensembles import reporting
    from hydra_ensembles.evaluation import ood_scores
    from hydra_ensembles.evaluation.conformal import benjamini_hochberg
    from hydra_ensembles.evaluation.uncertainty import predict_records
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.saving.files import atomic_write_records

    from .guards import check_output_file

    ray = args.engine == "ray"
    out = check_ray_options(args) if ray else check_output_file(args.out, (".csv", ".jsonl"))
    plot = check_output_file(args.plot, (".png",)) if args.plot else None
    if plot is not None and not args.val_data:
        raise InputError("--plot draws the data's OOD scores against --val-data's: give --val-data")
    models, preprocessor = _load_methods(args.model, args)
    if args.preprocessor:
        preprocessor = load_preprocessor(args.preprocessor)
    model = models[0] if len(models) == 1 else models
    if ray:
        return _predict_on_ray(args, out, model, models, preprocessor)
    dataset, batches = _data_batches(args.data, args, preprocessor, labels=args.labelled, model=models)
    classes = _class_names(args, dataset, models[0])
    val_batches = _data_batches(args.val_data, args, preprocessor, model=models)[1] if args.val_data else None
    calibration, val = _calibration(args, model, len(models), val_batches)
    flag_score = _flag_score(args, calibration)
    preds, rows, forward = predict_records(
        model, dataset, batches, calibration, classes, precision=args.precision, flag_score=flag_score
    )
    if args.fdr is not None:  # the batch's selection, in place of the per-input flag
        selected = benjamini_hochberg([r["ood_p_value"] for r in rows], args.fdr)
        for row, chosen in zip(rows, selected, strict=True):
            row["flagged"] = bool(chosen)
    summary = []
    if plot is not None:  # where the data's scores fall against ID validation, and the threshold
        t, statistics = calibration.temperature, calibration.flag.statistics
        scores = {
            f"ID validation ({args.val_data})": ood_scores(val, flag_score, t, statistics),
            f"data ({args.data})": ood_scores(preds, flag_score, t, statistics),
        }
        reporting.score_histograms(scores, plot, flag_score, calibration.flag.threshold)
        summary.append(f"score histograms -> {plot}")
    atomic_write_records(out, rows)
    total = time.perf_counter() - STARTED
    timing = (
        f"the models' forward passes took {forward:.2f} s of the command's {total:.2f} s (imports included)"
    )
    print(
        "\n".join([f"{len(rows)} predictions -> {out}", *summary, *_summary(rows, calibration, args), timing])
    )
    return 0


def _class_names(args: argparse.Namespace, dataset, model) -> list[str] | None:
    """The class names of the records: the data's where it is labelled, else the model's."""
    if args.labelled and dataset.classes:
        return dataset.classes
    id2label = getattr(model.config, "id2label", None) or {}
    return [str(id2label.get(i, id2label.get(str(i), i))) for i in range(len(id2label))] or None


def _predict_on_ray(args: argparse.Namespace, out, model, models: list, preprocessor) -> int:
    """``--engine ray``: the calibration (saved, or fit here on ``--val-data``), then the job."""
    from .predict_ray import predict_on_ray

    val = _data_batches(args.val_data, args, preprocessor, model=models)[1] if args.val_data else None
    calibration, _ = _calibration(args, model, len(models), val)
    _resolve_length(args, models)
    classes = _class_names(args, None, model)
    return predict_on_ray(args, out, calibration, _flag_score(args, calibration), classes)


def _flag_score(args: argparse.Namespace, calibration) -> str:
    """The score the records flag on (the calibration's, else ``--flag-score`` or msp); InputError
    where it or ``--fdr`` needs a calibration that is not there."""
    from hydra_ensembles.ood import feature_scores

    flag_score = calibration.flag.score if calibration is not None else args.flag_score or "msp"
    if calibration is None and flag_score in feature_scores():
        raise InputError(
            f"--flag-score {flag_score} reads the feature statistics of a calibration: give --val-data "
            "for a model saved with them (build or finetune with --data and --val-data)"
        )
    if args.fdr is not None and (calibration is None or calibration.flag.method != "conformal"):
        raise InputError(
            "--fdr selects by conformal p-values: it needs a conformal calibration (saved or --val-data)"
        )
    return flag_score


def _calibration(args: argparse.Namespace, model, num_models: int, val_batches: list[dict] | None):
    """The calibration to predict with, and the ID validation predictions where it was fit here:
    fit on ``--val-data``, else the one saved with a single model (refused where ``--flag-score``
    or ``--keep`` ask for another), else none (with a warning)."""
    from hydra_ensembles.calibration import CalibrationConfig, fit_calibration, saved_calibration
    from hydra_ensembles.calibration.calibration import check_calibration_data
    from hydra_ensembles.calibration.provenance import NO_DATA
    from hydra_ensembles.ood import feature_scores

    saved = saved_calibration(model) if num_models == 1 else None
    calibration = None if val_batches is not None else saved
    flag = calibration.flag if calibration is not None else None
    asked = (args.flag_score or flag.score, args.keep or flag.keep) if flag is not None else None
    if flag is not None and asked != (flag.score, flag.keep):
        raise InputError(
            f"{args.model}'s saved calibration flags on {flag.score} keeping {flag.keep:.0%} "
            "of ID validation: pass --val-data to fit another with --flag-score/--keep"
        )
    _say_precision(args)
    if val_batches is not None:  # the saved calibration's settings, unless the options ask for others
        config = saved.config if saved is not None else CalibrationConfig()  # the library's defaults
        config = config.replace(**{k: v for k, v in (("score", args.flag_score), ("keep", args.keep)) if v})
        check_calibration_data(val_batches, config, model)
        feature = config.score in feature_scores()  # only a feature score reads the statistics
        kept = saved is not None and feature and saved.flag.statistics is not None
        fit = fit_calibration(
            model,
            val_batches,
            config,
            data=args.val_data,
            precision=args.precision,
            statistics=saved.flag.statistics if kept else None,
            statistics_data=saved.provenance.statistics if kept else NO_DATA,
        )
        calibration, val = fit.calibration, fit.validation
        source = "the saved calibration's" if saved is not None else "the defaults'"
        was = f"; the saved temperature was {saved.temperature:.3f}" if saved is not None else ""
        print(
            f"calibration fit on --val-data (not saved with the model; settings not given as options are "
            f"{source}; the temperature is refit on --val-data{was}): {calibration.describe()}"
        )
        return calibration, val
    if calibration is not None:
        print(f"calibration saved with the model: {calibration.describe()}")
    else:
        print(
            f"hydra-ens: warning: {args.model} carries no calibration and no --val-data was given: "
            "probabilities at temperature 1 and no OOD flag (fit one with build/finetune/zero-shot "
            "--val-data, or pass --val-data here)",
            file=sys.stderr,
        )
    return calibration, None


def _summary(rows: list[dict], calibration, args: argparse.Namespace) -> list[str]:
    """The share of inputs flagged and, for labelled data, the accuracy."""
    lines = []
    if calibration is not None:
        flag = calibration.flag
        flagged = sum(r["flagged"] for r in rows) / len(rows)
        how = (
            f"conformal p-value <= {flag.alpha:.3g}"
            if flag.method == "conformal"
            else f"keeping {flag.keep:.0%} of ID validation"
        )
        if args.fdr is not None:
            lines.append(
                f"flagged (Benjamini-Hochberg on the {len(rows)} inputs' conformal p-values of "
                f"ood_score_{flag.score}, false discovery rate {args.fdr:g}): {flagged:.1%}"
            )
            if not flagged:
                lines.append(_nothing_selected(rows, calibration, args.fdr))
        else:
            lines.append(f"flagged (ood_score_{flag.score} > {flag.threshold:.4f}, {how}): {flagged:.1%}")
    if args.labelled:
        lines.append(f"accuracy {sum(r['correct'] for r in rows) / len(rows):.4f}")
    return lines


def _nothing_selected(rows: list[dict], calibration, fdr: float) -> str:
    """Why Benjamini-Hochberg selected nothing: the smallest p-value against what one selection
    needs, and the smallest a p-value can be with this many calibration inputs."""
    n, m = len(calibration.flag.calibration_scores), len(rows)
    smallest = min(r["ood_p_value"] for r in rows)
    return (
        f"nothing selected: the smallest p-value is {smallest:.4g}, and one selection needs a p-value "
        f"<= {fdr:g}/{m} = {fdr / m:.4g} (k of them <= k x {fdr:g}/{m}); with {n} calibration inputs no "
        f"p-value is below 1/{n + 1} = {1 / (n + 1):.4g}: calibrate on more ID validation data, or flag "
        "on a score that separates better (docs/ood.md, 'When nothing can be selected')"
    )


def _add_predict_arguments(pred: argparse.ArgumentParser) -> None:
    pred.add_argument(
        "model", help="PATH[,PATH...]: a saved Hydra model, member or HF model; several = ensemble"
    )
    pred.add_argument("--data", required=True, help="the inputs (unlabelled unless --labelled)")
    pred.add_argument("--labelled", action="store_true", help="the data has labels: add label and correct")
    pred.add_argument(
        "--val-data",
        help="labelled ID validation data: fit the temperature and the flag threshold on it instead "
        "of using the calibration saved with the model",
    )
    pred.add_argument(
        "--flag-score",
        type=ood_score,
        metavar="SCORE",
        help=f"OOD score to flag on, with --val-data (default: the saved calibration's, else msp): "
        f"{REGISTERED_SCORES} (these need a model saved with feature statistics), and any an "
        "installed package registers",
    )
    pred.add_argument(
        "--keep",
        type=_fraction,
        help="share of ID validation inputs left unflagged, with --val-data (default: the saved "
        "calibration's, else 0.95)",
    )
    pred.add_argument(
        "--fdr",
        type=_fraction,
        help="flag the inputs Benjamini-Hochberg selects on their conformal p-values at this false "
        "discovery rate (e.g. 0.1: in expectation at most 10%% of the flagged inputs are ID), in "
        "place of the per-input flag, which bounds the share of ID inputs flagged instead",
    )
    _random_head_option(pred)
    pred.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    pred.add_argument(
        "--out",
        required=True,
        help="output file: .csv or .jsonl; with --engine ray, a folder of Parquet files and their manifest",
    )
    engine_options(pred)
    pred.add_argument(
        "--plot",
        help="with --val-data: also draw where the data's OOD scores fall against the validation "
        "data's, with the threshold (a .png file)",
    )
    _data_options(pred)


COMMAND = Command(
    "predict",
    help="per-input predictions with uncertainty and an OOD flag (CSV or JSON Lines)",
    add_arguments=_add_predict_arguments,
    run=_cmd_predict,
)
