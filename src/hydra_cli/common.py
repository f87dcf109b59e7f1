"""Steps shared by several commands: loading models and data, the preprocessor saved with a model,
calibration."""

from __future__ import annotations

import argparse
import sys

from hydra_ensembles.errors import InputError

from .options import calibration_config

DEFAULT_MAX_LENGTH = 128
"""Tokens per text where neither ``--max-length`` nor the model says."""


def _load_model(path: str, args: argparse.Namespace, num_labels: int | None = None, quiet: bool = False):
    """A model for a command that predicts with its head: refused where the head was initialised
    randomly (a base model) unless ``--allow-random-head`` says that is intended (and said,
    unless ``quiet``: a first look before the model is loaded again with the head it gets)."""
    from hydra_ensembles.loading import load_any
    from hydra_ensembles.models import untrained_weights

    model = load_any(path, num_labels or getattr(args, "num_labels", None))
    classes = getattr(getattr(model, "config", None), "num_labels", None)
    if isinstance(classes, int) and classes < 2:
        raise InputError(
            f"{path} classifies into {classes} class: a classifier needs at least two (its probability "
            "would always be 1; a regression head is no classifier)"
        )
    untrained = untrained_weights(model)
    if untrained and not getattr(args, "allow_random_head", False):
        raise InputError(
            f"{path} has no trained classifier head ({', '.join(untrained[:2])} would be random): "
            f"fine-tune it first (hydra-ens finetune {path} --data TRAIN --out DIR), or pass "
            "--allow-random-head where a random head is what you want"
        )
    if not quiet:
        _say_random_head(path, model)
    return model


def _say_random_head(path: str, model) -> None:
    """Say, once per command, that ``model``'s head was initialised randomly, where it was."""
    from hydra_ensembles.models import untrained_weights

    if untrained := untrained_weights(model):
        print(
            f"hydra-ens: note: {path} has no trained classifier for these classes: {', '.join(untrained)} "
            "start from random values (seeded), as a new task head does",
            file=sys.stderr,
        )


def _data_batches(
    spec: str,
    args: argparse.Namespace,
    preprocessor,
    limit: int | None = None,
    labels: bool = True,
    model=None,
    dataset=None,
):
    """The dataset ``spec`` names (``dataset``: already loaded), sampled down to ``limit`` items,
    as batches for ``model`` (`data.model_batches`: checked and label-aligned)."""
    from hydra_ensembles.data import load_spec, model_batches, stable_sample

    if dataset is None:
        dataset = load_spec(spec, args.text_column, args.label_column, labelled=labels)
    if limit:
        dataset = dataset.subset(stable_sample(range(len(dataset)), dataset.ids, limit, salt="cli"))
    _resolve_length(args, model)
    return model_batches(dataset, model, preprocessor, args.batch_size, args.max_length, labels, spec)


def _resolve_length(args: argparse.Namespace, model) -> int:
    """``--max-length``, resolved once per command so that every data set is cut alike: the
    length ``model`` was saved with where none was given, else `DEFAULT_MAX_LENGTH`."""
    from hydra_ensembles.data.registry import saved_length

    if args.max_length is None:
        args.max_length = saved_length(model) or DEFAULT_MAX_LENGTH
    return args.max_length


def _record_length(model, args: argparse.Namespace) -> None:
    """Save the token length a command trains or calibrates at with the model it writes (its
    metadata's ``max_length``), so predict, eval and the pipelines cut texts alike."""
    from hydra_ensembles.saving.metadata import write_metadata

    if args.max_length is not None and getattr(model, "config", None) is not None:
        write_metadata(model, max_length=int(args.max_length))


def _resolve_epochs(args: argparse.Namespace, train: list[dict]) -> int:
    """``--epochs``, with ``auto`` resolved for ``train``'s batches (`training.auto_epochs`) and
    said."""
    from hydra_ensembles.training import auto_epochs

    if args.epochs != "auto":
        return int(args.epochs)
    epochs = auto_epochs(len(train))
    print(f"--epochs auto: {epochs} epochs of {len(train)} optimizer steps (batches of {args.batch_size})")
    return epochs


def _print_epoch(record: dict) -> None:
    """Print a fine-tuning epoch's line as the epoch ends."""
    from hydra_ensembles.training import describe_epoch

    print(f"  {describe_epoch(record)}", flush=True)


def _print_history(result, config, val: list[dict] | None) -> None:
    """After fine-tuning (its epochs were printed as they ended, `_print_epoch`): which epoch was
    kept and why (``--patience``), and a warning where validation accuracy never rose above the
    share of the validation set's largest class (a model stuck on one class) or was still rising."""
    import warnings

    history = result.history
    if config.patience is not None and result.best_epoch is not None:
        best = history[result.best_epoch]
        stopped = f"; stopped early after epoch {len(history)}" if result.stopped_early else ""
        print(
            f"  kept epoch {result.best_epoch + 1} of {len(history)}: the lowest validation NLL "
            f"({best['val_nll']:.4f}; --patience keeps the best epoch by validation NLL){stopped}"
        )
    if val and history and "val_acc" in history[0]:
        import torch

        labels = torch.cat([b["labels"].reshape(-1) for b in val])
        majority = float(torch.bincount(labels).max()) / len(labels)
        if max(r["val_acc"] for r in history) <= majority + 1e-9:
            warnings.warn(
                f"validation accuracy never rose above {majority:.3f}, the share of the largest class: "
                "the model predicts one class; try a larger --lr or more --epochs",
                stacklevel=2,
            )
        elif still_learning(history) and not result.stopped_early:
            steps = ", ".join(f"{r['val_acc']:.2f}" for r in history[-3:])
            warnings.warn(
                f"validation accuracy was still rising at the last epoch ({steps}): the model is "
                "probably under-trained; more --epochs (or a larger --lr) would likely help",
                stacklevel=2,
            )


def still_learning(history: list[dict], tolerance: float = 0.005) -> bool:
    """Whether validation accuracy rose over each of the last two epochs by more than
    ``tolerance`` (three epochs at least): training stopped while the model was still learning."""
    accuracy = [r["val_acc"] for r in history if "val_acc" in r]
    return (
        len(accuracy) >= 3
        and accuracy[-1] > accuracy[-2] + tolerance
        and accuracy[-2] > accuracy[-3] + tolerance
    )


def _calibrate(model, batches: list[dict], args: argparse.Namespace, data: str, train=None, ood=None, **kept):
    """Fit ``model``'s calibration (`fit_calibration`, with ``calibration_config(args)``) on labelled
    ``batches`` named ``data``, with the feature statistics fit on the labelled training batches
    ``train`` (``--data``) or given in ``kept`` (``statistics``, ``statistics_data``), the flag
    score chosen on the OOD validation batches ``ood`` (``--ood-data``), where given; print every
    candidate score's AUROC on those, and record the calibration in the model, saved with it."""
    from hydra_ensembles.calibration import fit_calibration, record_calibration

    fit = fit_calibration(
        model, batches, calibration_config(args), data=data, precision=args.precision, id_train=train,
        train_data=args.data if train is not None else "", **kept, ood_validation=ood,
        ood_data=getattr(args, "ood_data", None) or "",
    )  # fmt: skip
    if fit.aurocs:
        _print_aurocs(fit.aurocs, fit.calibration.flag.score)
    calibration = record_calibration(model, fit.calibration)
    print(f"calibration: {calibration.describe()}")
    return calibration


def _print_aurocs(aurocs: dict[str, float], chosen: str) -> None:
    """Every candidate score's validation AUROC, best first, the flag score and inverted ones named."""
    print("validation AUROC of each score, ID validation against OOD validation (higher separates better):")
    for score, auroc in sorted(aurocs.items(), key=lambda item: -item[1]):
        note = "  <- the flag score" if score == chosen else ""
        note = note or ("  (inverted: ranks the OOD data as more in-distribution)" if auroc < 0.5 else "")
        print(f"  {score:<20} {100 * auroc:6.2f}{note}")


def _load_methods(spec: str, args: argparse.Namespace) -> tuple[list, object]:
    """Models named by ``PATH[,PATH...]`` (several = an explicit ensemble) and their tokenizer or
    image processor (saved beside them by build and finetune; else pass ``--tokenizer``); models saved
    with different preprocessors are refused as one ensemble, since one input would reach them as
    different token ids."""
    from hydra_ensembles.loading import load_preprocessor, preprocessing_signature

    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise InputError(f"no model path in {spec!r}")
    models = [_load_model(p, args) for p in paths]
    if len(models) > 1:  # checked before any work: the members of an explicit ensemble are models
        from hydra_ensembles.members.ensemble import DeepEnsemble

        DeepEnsemble(models)
    found = [(p, load_preprocessor(p)) for p in paths]
    found = [(p, pre) for p, pre in found if pre is not None]
    for path, pre in found[1:]:
        if preprocessing_signature(pre) != preprocessing_signature(found[0][1]):
            raise InputError(
                f"{found[0][0]} and {path} were saved with different tokenizers or image processors: "
                "an ensemble's members must read the same inputs"
            )
    return models, found[0][1] if found else None


def _say_precision(args: argparse.Namespace) -> None:
    """One line on stdout with the precision and why, once the inputs are checked and work begins
    (stderr keeps one line for a bad input)."""
    print(f"computing in {args.precision} ({args.precision_reason})")
