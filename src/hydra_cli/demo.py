"""``hydra-ens demo``: the paper's experiment on an embedded benchmark."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from hydra_ensembles.errors import InputError

from .command import Command
from .options import POSITIVE, precision_option, share


def _cmd_demo(args: argparse.Namespace) -> int:
    from hydra_ensembles.runtime import ensure_cpu_allocator_tuned
    from hydra_experiments import DemoConfig, run_demo

    from .guards import output_lock

    ensure_cpu_allocator_tuned()
    overrides = {
        "precision": args.precision,
        "seed": args.seed,
        "cache_dir": Path(args.cache_dir),
        "use_cache": not args.no_cache,
        "trunk_study": args.trunk_study,
        "bagging": args.bagging,
        "keep_base": args.keep_base,
        "mlp_keep": args.mlp_keep,
        "batch_ensemble": args.batch_ensemble,
        "oba": args.oba,
        "wanda": args.wanda,
        "packed": args.packed,
        "mimo": args.mimo,
    }
    if args.model:
        overrides["model"] = args.model
    if args.out:
        overrides["out_dir"] = Path(args.out)
    config = DemoConfig.preset(args.task, full=args.full, **overrides)
    if args.member_epochs is not None:
        config = replace(config, recipe=replace(config.recipe, member_epochs=args.member_epochs))
    if args.seeds and args.task == "zero-shot":
        raise InputError("--seeds runs the supervised demos (text, image)")
    with output_lock(config.out_dir):  # its default folder too: one demo writes it at a time
        if args.seeds:
            from hydra_experiments import run_seeds

            run_seeds(config, [int(s) for s in args.seeds.split(",") if s.strip()])
        elif args.task == "zero-shot":
            from hydra_experiments.zero_shot import run_zero_shot_demo

            run_zero_shot_demo(config)
        else:
            run_demo(config)
    return 0


OPT_IN = {
    "--trunk-study": "also build Hydra with a shared trunk of L/3 and L/2 layers and compare",
    "--batch-ensemble": "also report a BatchEnsemble baseline (M members)",
    "--packed": "also report Packed-Ensembles (alpha=2 from scratch; alpha=M from the pretrained weights)",
    "--mimo": "also report MIMO (M inputs in one pass; rho 0.5, batch repeat 4)",
    "--oba": "also report OBA (unstructured, second-order), as many parameters as Taylor, fine-tuned",
    "--wanda": "also report Wanda (unstructured, |W| x input norm), as many parameters as Taylor, fine-tuned",
}
"""The demo's opt-in rows (each an extra method, off by default to keep the default run short)."""


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    from hydra_ensembles.models import DEFAULT_TEXT_MODEL
    from hydra_experiments.pretrained import DEFAULT_IMAGE_MODEL

    demo.add_argument(
        "--task",
        choices=["text", "image", "zero-shot"],
        default="text",
        help="text (default), image or zero-shot (MiniLM-L6 as a dual encoder on BBC News topics, "
        "no training); run times on a 2-core CPU are in docs/results.md",
    )
    demo.add_argument(
        "--full",
        action="store_true",
        help="the larger protocol: all training data, longer inputs, fp32 evaluation (zero-shot: "
        "all-mpnet-base-v2 on every test text); many times longer than the default",
    )
    demo.add_argument(
        "--model",
        help=f"text: a BERT/RoBERTa/DistilBERT hub id or directory (default {DEFAULT_TEXT_MODEL}); "
        f"image: {DEFAULT_IMAGE_MODEL} (default; dinov2-s-<px> for another input size) or "
        "vit-6x12-p7 (a small ViT trained from scratch)",
    )
    seeds = demo.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="seed of the run (default: %(default)s)")
    seeds.add_argument(
        "--seeds",
        help="comma-separated seeds, e.g. 0,1,2: the demo once per seed (cached models are reused), "
        "then mean ± std over the seeds (seeds.md)",
    )
    _member_study_options(demo)
    demo.add_argument("--out", help="report folder (default runs/demo, image: runs/demo-image)")
    demo.add_argument("--cache-dir", default="runs/cache", help="cached models and rankings")
    demo.add_argument("--no-cache", action="store_true", help="recompute everything")
    for flag, help_text in OPT_IN.items():
        demo.add_argument(flag, action="store_true", help=help_text)
    precision_option(demo)


def _member_study_options(demo: argparse.ArgumentParser) -> None:
    """How every Hydra's members are made: the member studies."""
    demo.add_argument(
        "--member-epochs",
        type=POSITIVE,
        help="epochs each pruned member is fine-tuned from the base (default: the preset's, text 1, "
        "image 2): a member-training study",
    )
    demo.add_argument(
        "--keep-base",
        action="store_true",
        help="each Hydra's member 1 is the fine-tuned base model itself beside M - 1 pruned members "
        "(build --keep-base): a member-diversity study",
    )
    demo.add_argument(
        "--bagging",
        action="store_true",
        help="each pruned member trains on its own bootstrap resample of the training data "
        "(bagging, build --bootstrap): a member-diversity study",
    )
    demo.add_argument(
        "--mlp-keep",
        type=share,
        default=1.0,
        help="the share of each layer's MLP neurons every Hydra member keeps (build --mlp-keep): a "
        "cost study; default 1",
    )


COMMAND = Command(
    "demo",
    help="the paper's experiment on an embedded benchmark (text: MiniLM-L6 on BBC News; "
    "image: pretrained DINOv2-S fine-tuned on Fashion-MNIST)",
    add_arguments=_add_demo_arguments,
    run=_cmd_demo,
    locks_outputs=False,
    reports_precision=True,
)
