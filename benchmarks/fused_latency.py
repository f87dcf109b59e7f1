"""Fused Hydra model vs its members run one after another, on the real MiniLM-L6.

Prints median latency (batch 32 x 128 tokens by default) of the single model, the M pruned members
run one after another, and the fused model, in fp32 and bf16; their ratios; and the multiply-add
ratio fused / sequential from ``torch.utils.flop_counter``. Target: the latency ratio fused /
sequential within 10% of the multiply-add ratio.

    python benchmarks/fused_latency.py [--batch 32] [--tokens 128] [--repeats 10]
"""

from __future__ import annotations

import argparse
import json
import random
from functools import partial

import torch

import hydra_ensembles as he
from hydra_ensembles.cost import interleaved_latency, median, multiply_adds
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.runtime import describe_machine, tune_cpu_allocator


def random_head_sets(num_members: int, layers: int, heads: int, keep: int, seed: int) -> list[he.HeadSet]:
    rng = random.Random(seed)
    return [
        he.HeadSet({layer: sorted(rng.sample(range(heads), keep)) for layer in range(layers)})
        for _ in range(num_members)
    ]


def run_all(models: list, inputs: dict) -> list:
    return [m(**inputs) for m in models]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="skip hydra_ensembles.runtime.tune_cpu_allocator (glibc's default: mmap per large tensor)",
    )
    args = parser.parse_args()
    offline_by_default()
    tuned = False if args.default_allocator else tune_cpu_allocator()

    base = load_classifier(num_labels=4).eval()
    config = base.config
    head_sets = random_head_sets(
        args.members, config.num_hidden_layers, config.num_attention_heads, args.keep, seed=0
    )
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(1000, config.vocab_size, (args.batch, args.tokens), generator=generator),
        "attention_mask": torch.ones(args.batch, args.tokens, dtype=torch.long),
    }
    print(
        f"machine: {describe_machine()}; MiniLM-L6, batch {args.batch} x {args.tokens} tokens, "
        f"M={args.members}, {args.keep}/{config.num_attention_heads} heads per layer; "
        f"allocator tuned: {tuned}"
    )
    results = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        single = base.to(dtype)
        members = [he.prune(single, hs).eval() for hs in head_sets]
        hydra = he.fuse(single, head_sets).eval()
        runs = {
            "single": partial(single, **inputs),
            "members_sequential": partial(run_all, members, inputs),
            "fused": partial(hydra, **inputs),
        }
        with torch.inference_mode():
            max_diff = max(
                (hydra(**inputs).member_logits[i].float() - m(**inputs).logits.float()).abs().max().item()
                for i, m in enumerate(members)
            )
        macs = {name: multiply_adds(run) for name, run in runs.items()}
        times = {name: median(t) for name, t in interleaved_latency(runs, repeats=args.repeats).items()}
        row = {
            "latency_s": times,
            "multiply_adds": macs,
            "latency_ratio_fused_vs_sequential": times["fused"] / times["members_sequential"],
            "mac_ratio_fused_vs_sequential": macs["fused"] / macs["members_sequential"],
            "latency_ratio_fused_vs_single": times["fused"] / times["single"],
            "max_abs_diff_fused_vs_members": max_diff,
        }
        row["within_target"] = (
            row["latency_ratio_fused_vs_sequential"] <= 1.10 * row["mac_ratio_fused_vs_sequential"]
        )
        results[dtype_name] = row
        print(f"\n[{dtype_name}]")
        for name in runs:
            print(f"  {name:20s} {times[name] * 1e3:9.1f} ms   {macs[name] / 1e9:7.2f} GMAC")
        print(
            f"  fused / sequential: latency {row['latency_ratio_fused_vs_sequential']:.3f}, "
            f"multiply-adds {row['mac_ratio_fused_vs_sequential']:.3f} "
            f"-> {'within' if row['within_target'] else 'OUTSIDE'} the 10% target"
        )
        print(
            f"  fused / single latency {row['latency_ratio_fused_vs_single']:.3f}; "
            f"max |fused - members| = {max_diff:.2e}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
