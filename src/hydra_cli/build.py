"""``hydra-ens build``: members from a ranking, optional fine-tuning, the fused Hydra model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra_ensembles.errors import InputError
from hydra_ensembles.saving.files import RUN_MARKER

from .command import Command
from .common import (
    _data_batches,
    _load_model,
    _print_history,
    _record_length,
    _resolve_epochs,
    _say_precision,
)
from .options import (
    COUNT,
    POSITIVE,
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _num_labels_option,
    _overwrite_option,
    _random_head_option,
    _training_options,
    calibration_config,
    share,
)
from .predict_ray import engine_options

FINISHED = "hydra/hydra_config.json"
"""What a finished build's output holds."""
WRITTEN = ("checkpoints", "members", "hydra")
"""What build writes in its output folder step by step (and resumes from)."""
OWNED = (*WRITTEN, RUN_MARKER)
"""Everything build leaves in its output folder: what it writes and the marker of its run."""
UNSETTING = ("out", "overwrite", "keep_checkpoints")
"""Options that do not change what a build computes (a rerun that differs only in them resumes)."""


def settings_key(args: argparse.Namespace, unsetting: tuple[str, ...] = UNSETTING) -> str:
    """The digest of the options a resumable command computes from (all but ``unsetting``): a
    rerun with the same ones resumes its output folder; what a run with others left is refused,
    or with ``--overwrite`` removed first (`saving.files.claim_run_dir`)."""
    from hydra_ensembles.hashing import json_digest

    plain = (str, int, float, bool, type(None), list, tuple)
    return json_digest(
        {k: v for k, v in sorted(vars(args).items()) if k not in unsetting and isinstance(v, plain)}
    )


def start_building(args: argparse.Namespace) -> tuple:
    """What a command that builds members starts from, once its options are checked: the model,
    the ranking read for it and its preprocessor (the precision said)."""
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.scoring.files import read_ranking

    if args.fine_tune and not args.data:
        raise InputError("--fine-tune needs --data (labelled training data)")
    if args.bootstrap and not args.fine_tune:
        raise InputError("--bootstrap resamples the members' training data: it needs --fine-tune")
    if getattr(args, "ood_data", None) and not args.val_data:
        raise InputError("--ood-data chooses the flag score of the calibration: it needs --val-data")
    if args.num_pruned == 0 and not args.fine_tune:
        raise InputError(
            "--num-pruned 0: members that keep every head differ only by their fine-tuning: give --fine-tune"
        )
    if args.scores is None and args.num_pruned != 0:
        raise InputError("--scores is required (a ranking written by hydra-ens score), unless --num-pruned 0")
    model = _load_model(args.model, args)
    ranking = None if args.num_pruned == 0 else read_ranking(args.scores, model)
    preprocessor = load_preprocessor(args.preprocessor or args.model)
    _say_precision(args)
    return model, ranking, preprocessor


def _cmd_build(args: argparse.Namespace) -> int:
    import dataclasses
    import shutil

    from hydra_ensembles.build import build_hydra, save_with_preprocessor
    from hydra_ensembles.saving.files import claim_run_dir, replace_dir

    from .guards import check_output_dir, overwrite_staging

    target = check_output_dir(args.out, finished=FINISHED, resumable=OWNED, overwrite=args.overwrite)
    out = overwrite_staging(target, FINISHED, OWNED) if args.overwrite else target
    _check_ray_build(args)
    model, ranking, preprocessor = start_building(args)
    train, classes, val, ood = _build_data(args, preprocessor, model)
    _record_length(model, args)  # the members and the fused model inherit it, saved with them
    config = _build_config(args, train)
    tuning = config.fine_tune

    def trained(m: int, member, result) -> None:  # each member saved as soon as it is trained
        _print_history(result, dataclasses.replace(tuning, seed=args.seed + m), val)
        save_with_preprocessor(member, out / "members" / f"member-{m}", preprocessor)

    with claim_run_dir(out, settings_key(args), WRITTEN, restart=args.overwrite, beside=out != target):
        built = build_hydra(
            model,
            train,
            val,
            config=config,
            ranking=ranking,
            classes=classes,
            validation_name=args.val_data or "",
            train_name=args.data or "",
            ood_validation=ood,
            checkpoint_dir=out / "checkpoints",
            on_member=trained,
            statistics=_ray_statistics(args, preprocessor, out / "checkpoints")
            if args.engine == "ray"
            else None,
            log=lambda line: print(line, file=sys.stderr),
        )
    _describe(built, model)
    built.save_pretrained(out, preprocessor, members_saved=True)  # the fused model's config last
    if not args.keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    if out != target:  # an overwrite, built beside the old result: now it replaces it whole
        replace_dir(target, out)
    print(f"saved the fused model to {target / 'hydra'}")
    return 0


def _check_ray_build(args: argparse.Namespace) -> None:
    """InputError, before any work, where ``--engine ray`` cannot fit the feature statistics."""
    if args.engine != "ray":
        return
    from hydra_ensembles.distributed import data_files, require_ray

    require_ray()
    if not args.data or not args.val_data:
        raise InputError(
            "--engine ray fits the calibration's feature statistics on --data: give the labelled training "
            "data and --val-data"
        )
    data_files(args.data)


def _ray_statistics(args: argparse.Namespace, preprocessor, staging: Path):
    """`build_hydra`'s ``statistics``: a built model (the fused one; the members' ensemble) saved
    into ``staging`` for Ray's workers to load, its feature statistics fit over ``--data`` on Ray,
    the saved copy removed."""
    import os
    import shutil

    from hydra_ensembles.saving.files import check_own_tree

    from .predict_ray import statistics_on_ray

    def fit(model) -> tuple:
        folder = staging / "statistics-model"
        if os.path.lexists(staging):
            check_own_tree(staging)  # a link planted there since the run claimed it: refused
        if folder.exists():
            shutil.rmtree(folder)  # what a killed run left
        staging.mkdir(parents=True, exist_ok=True)
        folder.mkdir()
        _save_for_workers(model, folder, preprocessor)
        try:
            return statistics_on_ray(args, model, str(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return fit


def _save_for_workers(model, folder: Path, preprocessor) -> None:
    """``model`` saved in the format its loader reads: each member and their index for an ensemble
    of members, else the model's own."""
    from hydra_ensembles.build import save_preprocessor, save_with_preprocessor
    from hydra_ensembles.members.ensemble import DeepEnsemble, write_ensemble_index

    if not isinstance(model, DeepEnsemble):
        save_with_preprocessor(model, folder, preprocessor)
        return
    names = [f"member-{m}" for m in range(len(model.members))]
    for name, member in zip(names, model.members, strict=True):
        save_with_preprocessor(member, folder / name, preprocessor)
    save_preprocessor(preprocessor, folder)
    write_ensemble_index(folder, names, model.members[0].config)


def _build_data(args: argparse.Namespace, preprocessor, model) -> tuple:
    """The labelled training batches and their class names (None without ``--data``, and with
    ``--engine ray`` unless the members are fine-tuned on them: Ray's workers read them), the
    labelled validation batches and the unlabelled OOD validation batches (None where not given)."""
    from hydra_ensembles.data.labels import check_trainable

    train, classes = None, None
    if args.data and (args.engine != "ray" or args.fine_tune):
        dataset, train = _data_batches(args.data, args, preprocessor, model=model)
        check_trainable(dataset.labels, dataset.classes, args.data)
        classes = list(dataset.classes)  # saved models name their classes (predict, pipelines)
    val = _data_batches(args.val_data, args, preprocessor, model=model)[1] if args.val_data else None
    ood = None
    if args.ood_data:
        ood = _data_batches(args.ood_data, args, preprocessor, labels=False, model=model)[1]
    return train, classes, val, ood


def _build_config(args: argparse.Namespace, train: list[dict] | None):
    """The build's settings from the command line (``train``: the training batches, which
    ``--epochs auto`` is resolved for)."""
    from hydra_ensembles.build import BuildConfig
    from hydra_ensembles.training import FineTuneConfig

    tuning = None
    if args.fine_tune:
        epochs = _resolve_epochs(args, train)
        tuning = FineTuneConfig(epochs=epochs, lr=args.lr, seed=args.seed, patience=args.patience)
    return BuildConfig(
        num_members=args.members,
        num_pruned=args.num_pruned,
        heads_per_layer=args.heads_per_layer,
        pool_size=args.pool_size,
        seed=args.seed,
        shared_layers=args.shared_layers,
        fine_tune=tuning,
        bootstrap=args.bootstrap,
        keep_base=args.keep_base,
        mlp_keep=args.mlp_keep,
        mlp=args.mlp or ("exact" if args.num_pruned == 0 else "merge"),
        lora_rank=args.lora_rank,
        calibration=calibration_config(args),
        precision=args.precision,
    )


def _describe(built, model) -> None:
    """How much the members overlap, and the calibrations fit."""
    from hydra_ensembles.members import member_overlap
    from hydra_ensembles.surgery import original_heads_per_layer

    overlap = member_overlap(built.head_sets, original_heads_per_layer(model))
    print(f"{len(built.head_sets)} members; Jaccard overlap between members: {overlap.round(2).tolist()}")
    for what, calibration in (
        ("members' ensemble (members/)", built.members_calibration),
        ("fused model (hydra/)", built.calibration),
    ):
        if calibration is not None:
            print(f"the {what}: calibration: {calibration.describe()}")


def _member_options(build: argparse.ArgumentParser) -> None:
    """How the members are made: sampled heads, a shared trunk, their training and its data."""
    build.add_argument(
        "--pool-size",
        type=POSITIVE,
        help="the least useful heads each member samples its pruned heads from: per layer with "
        "--heads-per-layer, in the whole model with --num-pruned (default: twice the heads pruned, "
        "at most the heads the ranking ranks)",
    )
    build.add_argument(
        "--shared-layers",
        type=COUNT,
        default=0,
        help="the first K layers are one trunk the members share: the same heads, not fine-tuned, "
        "run once for all members (less compute; less member diversity). Default 0",
    )
    build.add_argument(
        "--keep-base",
        action="store_true",
        help="member 1 is the model itself, unpruned and not trained again; the other members are "
        "sampled and trained as usual (the single model inside the ensemble)",
    )
    build.add_argument(
        "--mlp-keep",
        type=share,
        default=1.0,
        help="the share of each layer's MLP neurons the members keep (the same neurons for every "
        "member, by weight norm): a narrower merged MLP, less compute; needs --fine-tune. Default 1",
    )
    build.add_argument(
        "--lora-rank",
        type=POSITIVE,
        help="with --fine-tune: each member trains LoRA adapters of this rank on W_Q and W_V (its task "
        "head in full), merged into its weights; with --num-pruned 0, a LoRA-Ensemble, fused (needs the "
        "baselines extra: peft)",
    )
    member_training_options(build)


def member_training_options(parser: argparse.ArgumentParser) -> None:
    """How members are trained, for every command that builds (``build``, ``sweep``)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fine-tune", action="store_true", help="fine-tune every member on --data")
    parser.add_argument(
        "--bootstrap",
        action="store_true",
        help="with --fine-tune: each member trains on its own bootstrap resample of --data (as many "
        "texts drawn with replacement; bagging, for members that differ in their data too)",
    )


def _add_build_arguments(build: argparse.ArgumentParser) -> None:
    build.add_argument("model", help="the model the ranking was computed on")
    build.add_argument(
        "--scores", help="JSON written by hydra-ens score (not read with --num-pruned 0: no head is pruned)"
    )
    build.add_argument("--members", type=POSITIVE, default=3)
    group = build.add_mutually_exclusive_group(required=True)
    group.add_argument("--heads-per-layer", type=COUNT, help="heads each member keeps per layer")
    group.add_argument(
        "--num-pruned",
        type=COUNT,
        help="heads each member prunes in total; 0: every member keeps every head, a deep ensemble of "
        "fine-tunes (with --fine-tune), fused",
    )
    _member_options(build)
    build.add_argument(
        "--data",
        help="labelled training data: for --fine-tune, and for the feature statistics of the OOD "
        "scores saved with the calibration",
    )
    build.add_argument(
        "--val-data",
        help="labelled ID validation data: early stopping, and the calibration (temperature, OOD "
        "flag score and threshold) saved with the fused model and the members' ensemble",
    )
    _training_options(build)
    build.add_argument(
        "--mlp",
        choices=["merge", "exact"],
        help="the members' MLPs in the fused model: merge (averaged, the paper) or exact (per member). "
        "Default: merge; exact with --num-pruned 0",
    )
    _num_labels_option(build)
    build.add_argument("--out", required=True, help="output directory (hydra/, members/, checkpoints/)")
    build.add_argument(
        "--keep-checkpoints", action="store_true", help="keep the fine-tuning checkpoints after success"
    )
    build.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _calibration_options(build, "--val-data")
    _random_head_option(build)
    _overwrite_option(build)
    _data_options(build)
    engine_options(build, "the feature statistics fit on --data")


COMMAND = Command(
    "build",
    help="members from a ranking -> optional fine-tuning -> fused Hydra model",
    add_arguments=_add_build_arguments,
    run=_cmd_build,
    resume="rerun the same command to resume (finished members and epochs are kept)",
)
