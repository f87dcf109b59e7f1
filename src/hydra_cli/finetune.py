"""``hydra-ens finetune``: fine-tune a classifier on labelled data, with its calibration."""

from __future__ import annotations

import argparse

from hydra_ensembles.errors import InputError

from .command import Command
from .common import (
    _calibrate,
    _data_batches,
    _load_model,
    _print_epoch,
    _print_history,
    _record_length,
    _resolve_epochs,
    _say_precision,
    _say_random_head,
)
from .options import (
    POSITIVE,
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _overwrite_option,
    _training_options,
    calibration_config,
)


def _check_options(args: argparse.Namespace) -> None:
    """InputError for options that contradict each other before any work."""
    if args.ood_data and not args.val_data:
        raise InputError("--ood-data chooses the flag score of the calibration: it needs --val-data")
    if args.val_data:
        from hydra_ensembles.evaluation.evaluate import check_flag_score

        check_flag_score(args.flag_score, 1, "a fine-tuned classifier")


def _model_for(args: argparse.Namespace, classes: int):
    """``--model`` loaded, with a fresh head of ``classes`` outputs where it has no trained head
    of that size and ``--num-labels`` does not say otherwise."""
    from hydra_ensembles.models import untrained_weights

    model = _load_model(args.model, args, num_labels=args.num_labels, quiet=True)
    if untrained_weights(model) and args.num_labels is None and model.config.num_labels != classes:
        model = _load_model(args.model, args, num_labels=classes, quiet=True)  # a fresh head for the data
    _say_random_head(args.model, model)
    return model


def _cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a classifier (e.g. a base model's fresh head) and save it as a Hugging Face model
    directory with its preprocessor and class names: what score and build start from."""
    import shutil
    from functools import partial

    from hydra_ensembles.build import name_classes, save_with_preprocessor
    from hydra_ensembles.calibration.calibration import check_calibration_data
    from hydra_ensembles.data import load_spec
    from hydra_ensembles.data.labels import check_trainable
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.members.storage import CLASSIFIER
    from hydra_ensembles.saving.files import atomic_dir, check_beside
    from hydra_ensembles.training import fine_tune

    from .guards import check_output_dir

    out = check_output_dir(
        args.out, finished="config.json", resumable=(), overwrite=args.overwrite, replaced=True
    )
    _check_options(args)
    dataset = load_spec(args.data, args.text_column, args.label_column)
    if not dataset.classes:
        raise InputError(f"{args.data} has no labels; fine-tuning needs labelled data")
    check_trainable(dataset.labels, dataset.classes, args.data)
    model = _model_for(args, len(dataset.classes))
    preprocessor = load_preprocessor(args.preprocessor or args.model)
    dataset, train = _data_batches(args.data, args, preprocessor, model=model, dataset=dataset)
    val = _data_batches(args.val_data, args, preprocessor, model=model)[1] if args.val_data else None
    ood = None
    if args.ood_data:
        ood = _data_batches(args.ood_data, args, preprocessor, labels=False, model=model)[1]
    name_classes(model, dataset.classes)
    if val is not None:
        check_calibration_data(val, calibration_config(args), model)
    config = _tuning(args, train)
    checkpoint = check_beside(out.with_name(out.name + ".checkpoint"))  # never through a planted link
    _say_precision(args)
    result = fine_tune(model, train, val, config, checkpoint_dir=checkpoint, on_epoch=_print_epoch)
    _print_history(result, config, val)
    _record_length(model, args)  # the length it was trained and calibrated at, saved with it
    if val is not None:
        _calibrate(model, val, args, args.val_data, train=train, ood=ood)
    atomic_dir(
        out, partial(save_with_preprocessor, model, preprocessor=preprocessor, saved=CLASSIFIER), marker=True
    )
    if not args.keep_checkpoints:
        shutil.rmtree(checkpoint, ignore_errors=True)
    print(f"saved the fine-tuned classifier ({len(dataset.classes)} classes) to {out}")
    return 0


def _tuning(args: argparse.Namespace, train):
    """The fine-tuning settings the options ask for (``--epochs auto`` resolved on ``train``)."""
    from hydra_ensembles.training import FineTuneConfig

    epochs = _resolve_epochs(args, train)
    return FineTuneConfig(epochs=epochs, lr=args.lr, seed=args.seed, patience=args.patience,
                          precision=args.precision, trainable=tuple(args.train.split(",")))  # fmt: skip


def _add_finetune_arguments(tune: argparse.ArgumentParser) -> None:
    tune.add_argument("model", help="HF id or directory (a base model gets a new head), or minilm-l6")
    tune.add_argument("--data", required=True, help="labelled training data")
    tune.add_argument(
        "--val-data",
        help="labelled ID validation data (reported; early stopping with --patience; the calibration "
        "saved with the model)",
    )
    _training_options(tune)
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument(
        "--train",
        default="attention,mlp,norm,classifier,embeddings",
        help="comma-separated parts to train: attention, mlp, norm, classifier (the task head: "
        "pooler and classification layer), embeddings",
    )
    tune.add_argument("--num-labels", type=POSITIVE, help="classes (default: those of --data)")
    tune.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    tune.add_argument("--out", required=True, help="output model directory (a Hugging Face model)")
    tune.add_argument("--keep-checkpoints", action="store_true", help="keep OUT.checkpoint/ after success")
    _calibration_options(tune, "--val-data")
    _overwrite_option(tune)
    _data_options(tune)
    tune.set_defaults(allow_random_head=True)


COMMAND = Command(
    "finetune",
    help="fine-tune a classifier (e.g. a base model's new head) on labelled data; save it with its "
    "preprocessor and class names (what score and build start from)",
    add_arguments=_add_finetune_arguments,
    run=_cmd_finetune,
    resume="rerun the same command to resume from the last finished epoch",
)
