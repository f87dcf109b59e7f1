"""``hydra-ens eval``: evaluate methods on ID and OOD data and write a report."""

from __future__ import annotations

import argparse

from hydra_ensembles.errors import InputError

from .command import Command
from .common import _data_batches, _load_methods, _say_precision
from .options import (
    POSITIVE,
    PREPROCESSOR_HELP,
    _data_options,
    _random_head_option,
    _report_overwrite_option,
    _resamples,
)


def _cmd_eval(args: argparse.Namespace) -> int:
    from hydra_ensembles import reporting
    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.data.labels import check_same_classes
    from hydra_ensembles.evaluation import (
        add_comparisons,
        add_score_comparisons,
        evaluate_method,
        predict,
        predict_method,
    )

    from .guards import check_report_dir, mark_report_dir

    out = check_report_dir(args.out, args.overwrite)
    items, oods_named = _named_options(args)
    methods: dict[str, list] = {}
    preprocessors: dict[str, object] = {}
    for name, _, paths in items:
        methods[name], preprocessors[name] = _load_methods(paths, args)
    models = [m for group in methods.values() for m in group]
    check_same_classes(models)  # every method is measured against one labelling of the data
    signatures, datasets = _data_per_preprocessor(args, preprocessors, models, oods_named)
    _say_precision(args)
    results, preds, draws = {}, {}, {}
    for name, group in methods.items():

        def predict_fn(model, batches, split, name=name):  # every layer's token: the layer scores too
            return predict(model, batches, f"{name}: {split}", precision=args.precision, layers=True)

        model = group[0] if len(group) == 1 else group
        data = datasets[signatures[name]]
        preds[name] = predict_method(model, data, predict_fn, calibrate=data.val is not None)
        saved = saved_calibration(model) if len(group) == 1 else None  # what is served
        rows, _, row_draws = evaluate_method(name, preds[name], bootstrap=args.bootstrap, saved=saved)
        results.update(rows)
        draws.update(row_draws)
    _warn_calibrated_apart(methods)
    training = _training_line(methods)
    first = next(iter(methods))  # every other method's differences from the first, paired
    add_comparisons(results, draws, [(name, first) for name in results if name != first])
    add_score_comparisons(results, draws)
    meta = {
        "command": "hydra-ens eval",
        "ID": args.id_data,
        "OOD": ", ".join(args.ood or []) or "none",
        "feature statistics fit on": args.train_data or "none (no --train-data: logit scores only)",
        "flag score chosen on": f"{args.val_data or 'no validation data'}"
        + (f" and OOD validation {args.ood_val}" if args.ood_val else ""),
        "precision": f"{args.precision} ({args.precision_reason})",
        "rows": "NAME: temperature 1; NAME + TS: fit on --val-data; NAME (as saved): the calibration "
        "saved with the model, as predict and the pipelines serve it",
        "training": training,
        "ECE": "15 equal-width bins of top-label confidence; aECE: 15 equal-mass bins (docs/metrics.md)",
    }
    reporting.write_results(mark_report_dir(out), results, meta=meta)
    reporting.method_plots(out / "plots", preds, list(preds), list(preds))
    print((out / "report.md").read_text())
    return 0


def _named_options(args: argparse.Namespace) -> tuple[list, list]:
    """``--method NAME=PATH[,PATH...]`` and ``--ood NAME=PATH`` parsed; InputError for a malformed
    one or a name given twice."""
    items = [item.partition("=") for item in args.method]
    bad = [f"{n}{sep}{paths}" for n, sep, paths in items if not (n and sep and paths)]
    if bad:
        raise InputError(f"--method wants NAME=PATH[,PATH...], got {bad[0]!r}")
    oods_named = [_ood_option(item) for item in args.ood or []]
    for option, names in (("--method", [n for n, _, _ in items]), ("--ood", [n for n, _, _ in oods_named])):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InputError(f"{option} names {repeated[0]!r} twice: give every {option} its own name")
    return items, oods_named


def _data_per_preprocessor(args: argparse.Namespace, preprocessors: dict, models: list, oods_named: list):
    """Each method's preprocessing signature, and the evaluation data read once per signature
    (each method reads its data through its own preprocessor; ``--preprocessor`` replaces them,
    and a method without one borrows another's)."""
    from hydra_ensembles.loading import load_preprocessor, preprocessing_signature

    if args.preprocessor:
        preprocessors = dict.fromkeys(preprocessors, load_preprocessor(args.preprocessor))
    known = [p for p in preprocessors.values() if p is not None]
    preprocessors = {
        name: p if p is not None else (known[0] if known else None) for name, p in preprocessors.items()
    }
    signatures = {name: preprocessing_signature(p) for name, p in preprocessors.items()}
    datasets: dict = {}
    for name, signature in signatures.items():
        if signature not in datasets:
            datasets[signature] = _eval_data(args, preprocessors[name], models, oods_named)
    return signatures, datasets


def _training_line(methods: dict[str, list]) -> str:
    """Each method's optimizer steps as its saved configuration records them, with a warning where
    the methods' training differs (their differences then mix method and training)."""
    import warnings

    from hydra_ensembles.training import training_records, training_summary

    summaries = {name: training_summary(group) for name, group in methods.items()}
    line = "; ".join(f"{name}: {summary or 'not recorded'}" for name, summary in summaries.items())
    steps = {frozenset(int(r["optimizer_steps"]) for r in training_records(g)) for g in methods.values()}
    if len(steps - {frozenset()}) > 1:
        warnings.warn(
            f"the methods were trained differently ({line}): their differences mix the method with "
            "its training; compare methods trained for the same number of steps",
            stacklevel=2,
        )
        line += " (differs: differences mix method and training)"
    return line


def _warn_calibrated_apart(methods: dict[str, list]) -> None:
    """Warn where the methods' saved calibrations (their "as saved" rows) were fit on different
    data (ID validation, OOD validation that chose the flag score, training data of the feature
    statistics, by SHA-256): their served flags then differ by their data too."""
    import warnings

    from hydra_ensembles.calibration import saved_calibration

    saved = {n: saved_calibration(g[0]) for n, g in methods.items() if len(g) == 1}
    read = {name: c.provenance for name, c in saved.items() if c is not None}
    fit_on = {name: provenance.digests for name, provenance in read.items()}
    if len(set(fit_on.values())) > 1:
        named = "; ".join(
            f"{name}: validation {read[name].validation.name or '?'}, OOD validation "
            f"{read[name].ood.name or 'none'}, statistics {read[name].statistics.name or 'none'}"
            for name in fit_on
        )
        warnings.warn(
            f"the methods' saved calibrations were fit on different data ({named}): their 'as saved' rows "
            "differ by their calibration data too; calibrate them on the same data (hydra-ens calibrate)",
            stacklevel=2,
        )


def _ood_option(item: str) -> tuple[str, str, str]:
    """``NAME=SPEC:near|far`` -> (name, spec, kind)."""
    name, _, rest = item.partition("=")
    spec, _, kind = rest.rpartition(":")
    if kind not in ("near", "far") or not spec or not name:
        raise InputError(f"--ood wants NAME=SPEC:near|far, got {item!r}")
    return name, spec, kind


def _eval_data(args: argparse.Namespace, preprocessor, models: list, oods_named: list):
    """The ID test (and shifted, validation) and OOD batches ``hydra-ens eval`` measures on."""
    from hydra_ensembles.data import to_batches
    from hydra_ensembles.evaluation import EvalData, shifted_sets

    id_dataset, id_test = _data_batches(args.id_data, args, preprocessor, args.limit, model=models)
    shift = {
        key: list(to_batches(data, preprocessor, args.batch_size, args.max_length))
        for key, data in (shifted_sets(id_dataset, args.shift_limit) if args.shift else {}).items()
    }
    oods = {
        name: (kind, _data_batches(spec, args, preprocessor, args.limit, labels=False, model=models[0])[1])
        for name, spec, kind in oods_named
    }
    val = (
        _data_batches(args.val_data, args, preprocessor, args.limit, model=models)[1]
        if args.val_data
        else None
    )
    train = (
        _data_batches(args.train_data, args, preprocessor, args.limit, model=models)[1]
        if args.train_data
        else None
    )
    ood_val = (
        _data_batches(args.ood_val, args, preprocessor, args.limit, labels=False, model=models[0])[1]
        if args.ood_val
        else None
    )
    return EvalData(id_test, oods, shift, val, train, ood_val)


def _add_eval_arguments(evaluate: argparse.ArgumentParser) -> None:
    evaluate.add_argument(
        "--method",
        action="append",
        required=True,
        help="NAME=PATH[,PATH...]: a saved Hydra model, member or HF model; several = ensemble",
    )
    evaluate.add_argument("--id-data", required=True, help="labelled ID test data")
    evaluate.add_argument("--ood", action="append", help="NAME=SPEC:near|far (repeatable)")
    evaluate.add_argument(
        "--val-data",
        help="labelled ID validation data: also report temperature scaling, and choose each method's "
        "flag score (docs/ood.md)",
    )
    evaluate.add_argument(
        "--train-data",
        help="labelled ID training data: fit each method's feature statistics on it and report the "
        "feature scores (every registered one) beside the logit scores",
    )
    evaluate.add_argument(
        "--ood-val",
        help="unlabelled OOD validation data (never a test set): chooses each method's flag score",
    )
    evaluate.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    evaluate.add_argument("--limit", type=POSITIVE, help="at most this many examples per dataset")
    evaluate.add_argument(
        "--shift",
        action="store_true",
        help="also measure accuracy and Brier under corruptions at severities 1-5",
    )
    evaluate.add_argument("--shift-limit", type=POSITIVE, default=100, help="ID test examples corrupted")
    evaluate.add_argument(
        "--bootstrap",
        type=_resamples,
        default=0,
        help="bootstrap resamples (e.g. 1000) for 95%% intervals of every main metric and paired "
        "differences (with p-values) of every method from the first --method",
    )
    _random_head_option(evaluate)
    evaluate.add_argument("--out", required=True, help="report folder")
    _report_overwrite_option(evaluate)
    _data_options(evaluate)


def _method_paths(args: argparse.Namespace) -> list[str]:
    """The paths in ``--method NAME=PATH[,PATH...]``."""
    return [path for item in args.method or [] for path in item.partition("=")[2].split(",")]


COMMAND = Command(
    "eval",
    help="evaluate methods on ID, OOD (near/far) data; write a report",
    add_arguments=_add_eval_arguments,
    run=_cmd_eval,
    extra_inputs=_method_paths,
)
