"""``hydra-ens fuse``: fuse members into one model that predicts like their ensemble in one pass:
untrained members given as head-set JSON files, or saved members (a deep ensemble of fine-tunes
of one pretrained model, pruned or keeping every head)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra_ensembles.errors import InputError

from .command import Command
from .common import _load_methods, _load_model
from .options import _num_labels_option, _overwrite_option, _random_head_option


def _cmd_fuse(args: argparse.Namespace) -> int:
    from hydra_ensembles.build import save_with_preprocessor
    from hydra_ensembles.data.registry import saved_length
    from hydra_ensembles.fusion import fuse
    from hydra_ensembles.fusion.model import CONFIG_NAME
    from hydra_ensembles.saving.metadata import read_head_sets, write_metadata

    from .guards import check_output_dir

    if args.members is not None and (args.model is not None or args.heads is not None):
        raise InputError("--members fuses saved members: give no MODEL and no --heads with it")
    if args.members is None and (args.model is None or args.heads is None):
        raise InputError("give MODEL with --heads (untrained members), or --members (saved members)")
    check_output_dir(args.out, finished=CONFIG_NAME, resumable=(), overwrite=args.overwrite)
    if args.members is None:
        head_sets = [hs for file in args.heads for hs in read_head_sets(file)]
        hydra = fuse(_load_model(args.model, args), head_sets)
        hydra.save_pretrained(args.out)
        print(f"fused {hydra.num_members} members into {args.out}")
        return 0
    if len(args.members) < 2:
        raise InputError("--members: an ensemble needs two saved members or more")
    members, preprocessor = _load_methods(",".join(args.members), args)
    hydra = fuse(members, mlp=args.mlp)
    length = saved_length(members)
    if length:  # predict, calibrate and the pipelines cut texts where the members were trained
        write_metadata(hydra, max_length=length)
    save_with_preprocessor(hydra, Path(args.out), preprocessor)
    print(
        f"fused {hydra.num_members} members ({args.mlp} MLPs) into {args.out}; it has no calibration "
        f"yet: hydra-ens calibrate {args.out} --val-data VAL --data TRAIN --out CALIBRATED"
    )
    return 0


def _add_fuse_arguments(fuse: argparse.ArgumentParser) -> None:
    fuse.add_argument("model", nargs="?", help="with --heads: HF id, local directory or minilm-l6")
    fuse.add_argument(
        "--heads",
        nargs="+",
        help="JSON files, each a head set {layer: [heads]} or a list of them (untrained members of MODEL)",
    )
    fuse.add_argument(
        "--members",
        nargs="+",
        help="saved members fine-tuned from one pretrained model (e.g. finetune outputs with different "
        "--seed; pruned or keeping every head): the fused model predicts like their ensemble",
    )
    fuse.add_argument(
        "--mlp",
        choices=("exact", "merge"),
        default="exact",
        help="with --members: exact (every part per member: the explicit ensemble's predictions, within "
        "rounding) or merge (the paper: MLPs and embeddings averaged)",
    )
    _num_labels_option(fuse)
    fuse.add_argument("--out", required=True, help="output directory")
    _random_head_option(fuse)
    _overwrite_option(fuse)


COMMAND = Command(
    "fuse",
    help="fuse members into one model: untrained ones from head-set JSON files, or saved members",
    add_arguments=_add_fuse_arguments,
    run=_cmd_fuse,
)
