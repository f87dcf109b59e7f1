"""Does torch.compile speed up the fused model? Eager vs compiled, same inputs, interleaved.

MiniLM-L6 fused from 3 members x 8/12 random heads, batch 64 x 128 tokens, in the given dtype.
Prints compile time, median latency of each, their ratio and the largest logit difference.

    python benchmarks/compile_speed.py [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

import hydra_ensembles as he
from hydra_ensembles.bench import random_head_sets
from hydra_ensembles.cost import interleaved_latency, median
from hydra_ensembles.models import load_classifier
from hydra_ensembles.runtime import describe_machine, tune_cpu_allocator


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tune_cpu_allocator()
    model = load_classifier(num_labels=4).eval().to(getattr(torch, args.dtype))
    hydra = he.fuse(model, random_head_sets(3, 6, 12, 8)).eval()
    ids = torch.randint(1000, 30000, (64, 128), generator=torch.Generator().manual_seed(0))
    inputs = hydra.stack_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 64)
    with torch.inference_mode():
        start = time.perf_counter()
        compiled = torch.compile(hydra.model, dynamic=False)
        compiled(**inputs)
        compile_s = time.perf_counter() - start
        times = interleaved_latency(
            {"eager": lambda: hydra.model(**inputs), "compiled": lambda: compiled(**inputs)},
            repeats=args.repeats,
        )
        diff = (hydra.model(**inputs).logits.float() - compiled(**inputs).logits.float()).abs().max().item()
    eager, comp = median(times["eager"]), median(times["compiled"])
    print(f"machine: {describe_machine()}; {args.dtype}, batch 64 x 128 tokens, M=3, 8/12 heads")
    print(
        f"compile + first call {compile_s:.1f} s; eager {eager * 1e3:.0f} ms, compiled {comp * 1e3:.0f} ms, "
        f"ratio {comp / eager:.3f}; max |logit diff| {diff:.1e}"
    )


if __name__ == "__main__":
    main()
