"""The ``hydra-ens`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .data import MissingDataError
from .models import DEFAULT_TEXT_MODEL, MissingModelError, offline_by_default


def _cmd_info(args: argparse.Namespace) -> int:
    from .adapters import get_adapter
    from .cost import count_parameters
    from .models import load_classifier
    from .surgery import kept_heads

    model = load_classifier(args.model, num_labels=args.num_labels)
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    kept = kept_heads(model).resolve(original)
    print(f"model: {args.model} ({type(model).__name__}, family {adapter.family})")
    print(f"layers: {len(original)}; heads per layer: {[len(k) for k in kept]} of {original}")
    print(f"parameters: {count_parameters(model):,}")
    return 0


def _cmd_fuse(args: argparse.Namespace) -> int:
    from .fusion import fuse
    from .heads import HeadSet
    from .models import load_classifier

    head_sets = []
    for file in args.heads:
        data = json.loads(Path(file).read_text())
        items = data if isinstance(data, list) else [data]
        head_sets += [HeadSet.from_dict(item) for item in items]
    model = load_classifier(args.model, num_labels=args.num_labels)
    hydra = fuse(model, head_sets)
    hydra.save_pretrained(args.out)
    print(f"fused {hydra.num_members} members into {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import QuickDemoConfig, run_quick_demo
    from .runtime import tune_cpu_allocator

    tune_cpu_allocator()
    config = QuickDemoConfig(
        model=args.model,
        num_members=args.members,
        heads_kept=args.heads_kept,
        seed=args.seed,
        out_dir=Path(args.out),
    )
    run_quick_demo(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydra-ens",
        description="Hydra Ensembles: prune attention heads M ways, fuse the members into one model.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="show a model's family, layers and heads")
    info.add_argument(
        "model", nargs="?", default=DEFAULT_TEXT_MODEL, help="HF id, local directory or minilm-l6"
    )
    info.add_argument("--num-labels", type=int, default=2)
    info.set_defaults(func=_cmd_info)

    fuse = sub.add_parser("fuse", help="fuse zero-shot members given as head-set JSON files")
    fuse.add_argument("model", help="HF id, local directory or minilm-l6")
    fuse.add_argument(
        "--heads",
        nargs="+",
        required=True,
        help="JSON files, each a head set {layer: [heads]} or a list of them",
    )
    fuse.add_argument("--num-labels", type=int, default=2)
    fuse.add_argument("--out", required=True, help="output directory")
    fuse.set_defaults(func=_cmd_fuse)

    demo = sub.add_parser("demo", help="small end-to-end run on MiniLM-L6 and BBC News")
    demo.add_argument("--model", default=DEFAULT_TEXT_MODEL)
    demo.add_argument("--members", type=int, default=3)
    demo.add_argument("--heads-kept", type=int, default=8, help="heads each member keeps per layer")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--out", default="runs/demo", help="where the fused model is saved")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    offline_by_default()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (MissingDataError, MissingModelError) as exc:
        print(f"hydra-ens: {exc}", file=sys.stderr)
        return 3
    except (ValueError, TypeError) as exc:
        print(f"hydra-ens: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
