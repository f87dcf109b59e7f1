"""``hydra-ens bench``: latency, parameters, multiply-adds and memory of every method."""

from __future__ import annotations

import argparse
import os

from .command import Command
from .options import COUNT, POSITIVE, _num_labels_option, _report_overwrite_option, int_list


def _cmd_bench(args: argparse.Namespace) -> int:
    from hydra_ensembles.adapters import get_adapter
    from hydra_ensembles.loading import load_any
    from hydra_ensembles.precision import resolve_precision
    from hydra_ensembles.runtime import ALLOCATOR_ENV, describe_machine, ensure_cpu_allocator_tuned
    from hydra_ensembles.saving.files import atomic_write_json, atomic_write_text
    from hydra_experiments.bench import BenchConfig, bench_report, random_inputs, run_bench

    from .guards import check_report_dir, mark_report_dir

    out = check_report_dir(args.out, args.overwrite)
    if args.default_allocator:
        os.environ[ALLOCATOR_ENV] = "0"
    ensure_cpu_allocator_tuned()
    chosen = [resolve_precision(name, args.device) for name in args.precision.split(",")]
    if len(chosen) == 1 and args.precision == "auto" and chosen[0].reduced:
        chosen.insert(0, resolve_precision("fp32", args.device))  # auto's pick beside fp32
    model = load_any(args.model, args.num_labels).eval()
    config = get_adapter(model).encoder_config(model)
    heads, trunk = _random_members(model, args)
    make_inputs = random_inputs(config, args.tokens, args.seed)
    setting = (
        f"{args.model}, M={args.members}, {args.heads_per_layer}/{config.num_attention_heads} heads per "
        f"layer (random, seed {args.seed}), {args.tokens} tokens, {args.repeats} interleaved runs, "
        f"device {args.device}"
        + (f", shared trunk of {args.shared_layers} layers" if args.shared_layers else "")
        + (f", compiled ({args.compile})" if args.compile != "off" else "")
    )
    precision = "; ".join(str(p) for p in chosen)
    print(f"machine: {describe_machine()}\nsetting: {setting}\nprecision: {precision}")
    bench = BenchConfig(
        batch_sizes=tuple(args.batch_sizes),
        dtypes=tuple(p.dtype_name for p in chosen),
        repeats=args.repeats,
        test_set=args.test_set,
        device=args.device,
        onnx=args.onnx,
        methods=None if args.methods is None else tuple(args.methods),
        compile_mode=None if args.compile == "off" else args.compile,
    )
    results = run_bench(model, heads, make_inputs, bench, trunk_head_sets=trunk)
    mark_report_dir(out)
    atomic_write_json(
        out / "bench.json",
        {"machine": describe_machine(), "setting": setting, "precision": precision, **results},
    )
    table = bench_report(results, describe_machine(), f"{setting}; precision: {precision}")
    atomic_write_text(out / "bench.md", table)
    print(table)
    return 0


def _random_members(model, args: argparse.Namespace) -> tuple[list, list | None]:
    """The benchmark's members: ``--members`` head sets keeping ``--heads-per-layer`` heads, every
    head equally likely (a flat ranking, seeded), and with ``--shared-layers K`` the same members
    sharing member 0's heads in the first K layers (else None)."""
    from functools import partial

    import torch

    from hydra_ensembles.adapters import get_adapter
    from hydra_ensembles.members import sample_members

    adapter = get_adapter(model)
    count = adapter.encoder_config(model).num_attention_heads
    sample = partial(
        sample_members,
        torch.zeros(adapter.num_layers(model), count),
        args.members,
        heads_per_layer=args.heads_per_layer,
        pool_size=count,
        seed=args.seed,
    )
    return sample(), (sample(shared_layers=args.shared_layers) if args.shared_layers else None)


def _method_list(text: str) -> list[str]:
    """An argparse type: comma-separated keys of the benchmark's methods."""
    from hydra_experiments.bench_methods import METHODS

    keys = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [k for k in keys if k not in METHODS]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(METHODS)}")
    return keys


def _device(text: str) -> str:
    """An argparse type: a device name (``cpu``, ``cuda``, ``cuda:1``); whether the machine has
    it is checked when the command starts."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: only cpu and cuda[:N] are supported")
    return text


def _add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    from hydra_ensembles.models import DEFAULT_TEXT_MODEL
    from hydra_experiments.bench_methods import METHODS

    bench.add_argument("model", nargs="?", default=DEFAULT_TEXT_MODEL)
    bench.add_argument("--members", type=POSITIVE, default=3)
    bench.add_argument("--heads-per-layer", type=COUNT, default=8)
    bench.add_argument("--tokens", type=POSITIVE, default=128)
    bench.add_argument("--batch-sizes", type=int_list(1), default="1,8,64", help="comma-separated")
    bench.add_argument(
        "--precision",
        default="auto",
        help="precisions to time, comma-separated (fp32,bf16,fp16); auto: fp32, plus bf16/fp16 where "
        "auto picks it (see --precision of the other commands)",
    )
    bench.add_argument("--repeats", type=POSITIVE, default=10)
    bench.add_argument(
        "--test-set", type=COUNT, default=351, help="inputs in the whole-test-set timing (0: skip)"
    )
    bench.add_argument(
        "--device", type=_device, default="cpu", help="cpu or cuda[:N] (timed with CUDA synchronisation)"
    )
    bench.add_argument(
        "--shared-layers",
        type=COUNT,
        default=0,
        help="also time Hydra with a shared trunk: the same members, sharing their first K layers' heads, "
        "which then run once",
    )
    bench.add_argument(
        "--methods",
        type=_method_list,
        default=None,
        help=f"comma-separated, from {','.join(METHODS)} (default: all; Single is always timed; "
        "trunk with --shared-layers)",
    )
    bench.add_argument(
        "--compile",
        choices=("off", "default", "reduce-overhead", "max-autotune"),
        default="off",
        help="time every model torch.compile'd in this mode, static shapes (reduce-overhead replays "
        "CUDA graphs on a GPU); compiling takes minutes",
    )
    bench.add_argument("--seed", type=int, default=0)
    _num_labels_option(bench)
    bench.add_argument(
        "--default-allocator",
        action="store_true",
        help="keep glibc's default allocator (the same as HYDRA_TUNE_ALLOCATOR=0)",
    )
    bench.add_argument("--out", default="runs/bench", help="report folder")
    _report_overwrite_option(bench)
    bench.add_argument(
        "--onnx",
        action="store_true",
        help="also time the fused model exported to ONNX and run by onnxruntime (float32, CPU)",
    )


COMMAND = Command(
    "bench",
    help="latency, parameters, multiply-adds and memory of every method",
    add_arguments=_add_bench_arguments,
    run=_cmd_bench,
    reports_precision=True,
)
