"""``hydra-ens fuse``: fuse untrained members given as head-set JSON files into one Hydra model."""

from __future__ import annotations

import argparse

from .command import Command
from .common import _load_model
from .options import _num_labels_option, _overwrite_option, _random_head_option


def _cmd_fuse(args: argparse.Namespace) -> int:
    from hydra_ensembles.fusion import fuse
    from hydra_ensembles.fusion.model import CONFIG_NAME
    from hydra_ensembles.saving.metadata import read_head_sets

    from .guards import check_output_dir

    check_output_dir(args.out, finished=CONFIG_NAME, resumable=(), overwrite=args.overwrite)
    head_sets = [hs for file in args.heads for hs in read_head_sets(file)]
    model = _load_model(args.model, args)
    hydra = fuse(model, head_sets)
    hydra.save_pretrained(args.out)
    print(f"fused {hydra.num_members} members into {args.out}")
    return 0


def _add_fuse_command(sub) -> argparse.ArgumentParser:
    fuse = sub.add_parser("fuse", help="fuse untrained members given as head-set JSON files")
    fuse.add_argument("model", help="HF id, local directory or minilm-l6")
    fuse.add_argument(
        "--heads",
        nargs="+",
        required=True,
        help="JSON files, each a head set {layer: [heads]} or a list of them",
    )
    _num_labels_option(fuse)
    fuse.add_argument("--out", required=True, help="output directory")
    _random_head_option(fuse)
    _overwrite_option(fuse)
    return fuse


COMMAND = Command(
    "fuse",
    add_parser=_add_fuse_command,
    run=_cmd_fuse,
)
