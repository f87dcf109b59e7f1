"""``hydra-ens score``: rank heads by Taylor importance or greedy circuit extraction."""

from __future__ import annotations

import argparse
from pathlib import Path

from .command import Command
from .common import _data_batches, _load_model, _say_precision
from .options import (
    COUNT,
    POSITIVE,
    PREPROCESSOR_HELP,
    _data_options,
    _num_labels_option,
    _random_head_option,
)


def _cmd_score(args: argparse.Namespace) -> int:
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.saving.files import atomic_write_json
    from hydra_ensembles.scoring import extract_circuit, taylor_head_set, taylor_scores
    from hydra_ensembles.scoring.taylor import DECIDING_PRECISION

    from .guards import check_output_file

    check_output_file(args.out, (".json",))
    if args.checkpoint:
        check_output_file(args.checkpoint, (".json",))
    model = _load_model(args.model, args)
    preprocessor = load_preprocessor(args.preprocessor or args.model)
    _, data = _data_batches(args.data, args, preprocessor, args.limit, model=model)
    _say_precision(args)
    if args.method == "taylor":
        # a ranking file decides which heads members prune: scored in fp32 on every machine
        scores = taylor_scores(model, data, progress=True, precision=DECIDING_PRECISION)
        heads = taylor_head_set(model, data, args.heads_per_layer, scope=args.scope)
        out = {
            "method": "taylor",
            "scores": scores.tolist(),
            "head_set": heads.to_dict(),
            "heads_per_layer": args.heads_per_layer,
            "scope": args.scope,
        }
    else:
        ood = (
            _data_batches(args.ood_data, args, preprocessor, args.limit, labels=False, model=model)[1]
            if args.ood_data
            else None
        )
        order = extract_circuit(model, data, ood, _circuit_config(args), checkpoint=args.checkpoint)
        out = {"method": "circuit", **order.to_dict()}
    out.update(precision=args.precision, precision_reason=args.precision_reason)
    atomic_write_json(args.out, out)
    if args.checkpoint and not args.keep_checkpoint:
        Path(args.checkpoint).unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


def _add_score_arguments(score: argparse.ArgumentParser) -> None:
    score.add_argument("model", help="a fine-tuned classifier: HF id or directory, or a saved member")
    score.add_argument("--method", choices=["taylor", "circuit"], default="circuit")
    score.add_argument(
        "--data",
        required=True,
        help="labelled ID validation/calibration data: a built-in name (bbc-news:val, ...) or a file",
    )
    score.add_argument("--ood-data", help="OOD *validation* data for --objective ood|avg (never a test set)")
    score.add_argument("--objective", choices=["acc", "ood", "avg"], default="avg")
    score.add_argument("--budget", type=POSITIVE, default=24, help="heads to remove (circuit)")
    score.add_argument("--min-heads-per-layer", type=COUNT, default=0)
    score.add_argument("--heads-per-layer", type=COUNT, default=8, help="heads kept per layer (taylor)")
    score.add_argument(
        "--scope",
        choices=["layer", "global"],
        default="layer",
        help="taylor: keep --heads-per-layer in each layer, or their sum over all layers",
    )
    score.add_argument("--limit", type=POSITIVE, help="use at most this many examples per dataset")
    score.add_argument(
        "--checkpoint", help="JSON file to resume an interrupted extraction (removed after success)"
    )
    score.add_argument("--keep-checkpoint", action="store_true", help="keep --checkpoint after success")
    score.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _random_head_option(score)
    score.add_argument(
        "--lazy",
        type=POSITIVE,
        metavar="K",
        help="approximate (lazy greedy) circuit extraction: score only the K best-known candidates "
        "per step between full refreshes (see benchmarks/circuit_speed.py for its agreement)",
    )
    score.add_argument(
        "--refresh-every", type=POSITIVE, default=8, help="--lazy: steps between full refreshes"
    )
    score.add_argument(
        "--cache-gb",
        type=float,
        default=2.0,
        help="memory cap for reusing hidden states across circuit steps (0: off; same result either way)",
    )
    _num_labels_option(score)
    score.add_argument("--out", required=True, help="output JSON file")
    _data_options(score)


def _circuit_config(args: argparse.Namespace):
    """The circuit extraction's settings from the command line (`scoring.CircuitConfig`)."""
    from hydra_ensembles.scoring import CircuitConfig

    return CircuitConfig(
        objective=args.objective,
        budget=args.budget,
        min_heads_per_layer=args.min_heads_per_layer,
        method="lazy" if args.lazy else "fast",
        shortlist=args.lazy or 8,
        refresh_every=args.refresh_every,
        cache_gb=args.cache_gb,
        precision=args.precision,
    )


def _score_resume(args: argparse.Namespace) -> str:
    if getattr(args, "checkpoint", None):
        return "rerun the same command with the same --checkpoint to resume"
    return "nothing was written; pass --checkpoint FILE to make a rerun resumable"


COMMAND = Command(
    "score",
    help="rank heads: Taylor importance or greedy circuit extraction (JSON)",
    add_arguments=_add_score_arguments,
    run=_cmd_score,
    resume=_score_resume,
)
