"""Token rows per inference chunk: the sweep behind ``runtime.CHUNK_CACHE_SHARE``.

Times the fused Hydra model (M=3, 8 of 12 heads per layer) and the single MiniLM-L6 at several
chunk sizes, interleaved, and prints the median latency of each; "whole" runs the batch at once.
The library's default (``runtime.inference_chunk_rows``) is printed beside them.

    python benchmarks/chunk_rows.py [--batch 64] [--tokens 128] [--rows 512,1024,2048,3072,4096]
"""

from __future__ import annotations

import argparse
import random
import statistics
from functools import partial

import torch

import hydra_ensembles as he
from hydra_ensembles.cost import interleaved_latency
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.runtime import (
    chunk_cache_bytes,
    describe_machine,
    inference_chunk_rows,
    last_level_cache_bytes,
)


def run_in_chunks(model, inputs: dict, per: int):
    batch = inputs["input_ids"].shape[0]
    return [model(**{k: v[i : i + per] for k, v in inputs.items()}) for i in range(0, batch, per)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rows", default="512,1024,2048,3072,4096")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    offline_by_default()
    base = load_classifier(num_labels=4).eval()
    config = base.config
    rng = random.Random(0)
    heads = [
        he.HeadSet({layer: sorted(rng.sample(range(12), 8)) for layer in range(config.num_hidden_layers)})
        for _ in range(3)
    ]
    hydra = he.fuse(base, heads).eval()
    ids = torch.randint(1000, config.vocab_size, (args.batch, args.tokens))
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cache, sized = last_level_cache_bytes(), chunk_cache_bytes()
    default = inference_chunk_rows(config.intermediate_size, 4, torch.device("cpu"))
    print(
        f"machine: {describe_machine()}; last-level cache {cache and cache >> 20} MiB (sysfs), "
        f"chunks sized for {sized >> 20} MiB"
    )
    print(f"batch {args.batch} x {args.tokens} tokens, fp32; library default: {default} rows per chunk")
    runs = {}
    for rows in [None, *(int(r) for r in args.rows.split(","))]:
        label = "whole" if rows is None else str(rows)
        runs[f"single/{label}"] = partial(run_in_chunks, base, x, max(1, (rows or 10**9) // args.tokens))

        def fused(rows=rows):
            hydra.chunk_rows = rows
            return hydra(**x)

        runs[f"hydra/{label}"] = fused
    times = {
        k: 1e3 * statistics.median(v) for k, v in interleaved_latency(runs, repeats=args.repeats).items()
    }
    for model in ("single", "hydra"):
        print(
            f"{model:7s}"
            + "  ".join(f"{k.split('/')[1]}: {v:.0f} ms" for k, v in times.items() if k.startswith(model))
        )


if __name__ == "__main__":
    main()
