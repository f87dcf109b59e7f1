"""Where a GPU forward pass spends its time: Single against the fused Hydra model.

For a model (``--model``: a folder; random weights are fine) and random members (``--members``,
``--heads-per-layer``), one batch of ``--batch`` inputs in ``--precision``: the wall time of a
forward pass (median of ``--repeats``, CUDA-synchronised), the GPU time its kernels take (the
profiler's sum over kernels), the number of kernel launches, and the kernels that take most of
the time. Wall time far above kernel time means the GPU waits for the host (launches); kernel
time in proportion to the multiply-adds means the GPU is full.

    python benchmarks/gpu_profile.py --model MODEL [--batch 64] [--precision bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hydra_ensembles.adapters import get_adapter
from hydra_ensembles.cost import multiply_adds
from hydra_ensembles.fusion import fuse
from hydra_ensembles.loading import load_any
from hydra_ensembles.members import sample_members
from hydra_ensembles.precision import DTYPE_NAMES, dtype_of
from hydra_experiments.bench import random_inputs


def _wall_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _kernels(run) -> tuple[float, int, list[tuple[str, float, int]]]:
    """GPU kernel time (ms), launches and the top kernels (name, ms, calls) of one call."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name].append(event.device_time_total / 1e3)
    total = sum(sum(v) for v in per_name.values())
    launches = sum(len(v) for v in per_name.values())
    top = sorted(((n, sum(v), len(v)) for n, v in per_name.items()), key=lambda x: -x[1])[:6]
    return total, launches, top


@torch.inference_mode()
def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--heads-per-layer", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--precision", default="bf16", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = load_any(args.model, 4).eval()
    adapter = get_adapter(model)
    config = adapter.encoder_config(model)
    heads = sample_members(
        torch.zeros(adapter.num_layers(model), config.num_attention_heads),
        args.members,
        heads_per_layer=args.heads_per_layer,
        pool_size=config.num_attention_heads,
    )
    dtype = dtype_of(args.precision)
    single = model.to("cuda", dtype)
    models = {"Single": single, "Hydra (fused)": fuse(single, heads).eval()}
    x = {k: v.to("cuda") for k, v in random_inputs(config, args.tokens, 0)(args.batch).items()}
    one = {k: v[:1] for k, v in x.items()}
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; batch {args.batch}, {args.precision}")
    for name, m in models.items():
        run = lambda m=m: m(**x)  # noqa: E731
        for _ in range(3):
            run()
        wall = _wall_ms(run, args.repeats)
        kernel_ms, launches, top = _kernels(run)
        gmacs = multiply_adds(lambda m=m: m(**one)) / 1e9 * args.batch
        print(
            f"{name}: wall {wall:.2f} ms, kernels {kernel_ms:.2f} ms in {launches} launches "
            f"({kernel_ms / wall:.0%} of wall), {gmacs:.0f} GMAC"
        )
        for kernel, ms, calls in top:
            print(f"    {ms:7.3f} ms  {calls:4d}x  {kernel[:100]}")


if __name__ == "__main__":
    main()
