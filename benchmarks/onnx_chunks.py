"""Tokens per onnxruntime run: the sweep behind ``serving.onnx_ops.GRAPH_CACHE_SHARE``.

Exports the fused Hydra model (real MiniLM-L6, M members keeping ``--keep`` of 12 heads per layer,
random, seed 0) as ``hydra-ens export`` does, quantizes a copy to int8 as ``--quantize int8``
does, and times both graphs on a batch of ``--batch`` random inputs of ``--tokens`` tokens, run
in pieces of at most each of ``--run-tokens`` tokens (`run_session`; "whole": the batch in one
run). The sizes are interleaved, best of ``--rounds`` rounds after a warm-up; the export's own
choice is printed beside them.

    python benchmarks/onnx_chunks.py [--batch 64] [--tokens 128] [--run-tokens 256,384,512,768,1024,1536]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import hydra_ensembles as he
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.runtime import chunk_cache_bytes, describe_machine
from hydra_ensembles.serving.onnx import ONNX_NAME, SIDECAR_NAME, export_onnx
from hydra_ensembles.serving.onnx_ops import inference_session, run_session
from hydra_ensembles.serving.quantization import quantize_int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--run-tokens", default="256,384,512,768,1024,1536")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    offline_by_default()
    torch.manual_seed(0)
    base = load_classifier("minilm-l6", num_labels=4).eval()
    heads = he.sample_members(torch.zeros(6, 12), args.members, heads_per_layer=args.keep, pool_size=12)
    hydra = he.fuse(base, heads).eval()
    names = ["input_ids", "token_type_ids", "attention_mask"]
    with tempfile.TemporaryDirectory() as folder:
        written = export_onnx(hydra, Path(folder) / "onnx", input_names=names)
        graph = (written / ONNX_NAME).read_bytes()
        chosen = json.loads((written / SIDECAR_NAME).read_text())["onnxruntime"]["tokens_per_run"]
    sessions = {"float32": inference_session(graph), "int8": inference_session(quantize_int8(graph))}
    ids = np.random.default_rng(0).integers(1000, base.config.vocab_size, (args.batch, args.tokens))
    feed = {"input_ids": ids, "token_type_ids": np.zeros_like(ids), "attention_mask": np.ones_like(ids)}
    sizes = [None] + [int(t) for t in args.run_tokens.split(",")]
    best: dict[tuple[str, int | None], float] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for kind, session in sessions.items():
            for size in sizes:
                settings = {"tokens_per_run": size, "tokens_per_input": None}
                start = time.perf_counter()
                run_session(session, feed, settings)
                seconds = time.perf_counter() - start
                if round_:
                    best[kind, size] = min(best.get((kind, size), float("inf")), seconds)
    print(f"machine: {describe_machine()}; cache for chunks {chunk_cache_bytes() >> 20} MiB")
    print(
        f"batch {args.batch} x {args.tokens} tokens, M={args.members}, {args.keep}/12 heads; "
        f"the export's tokens per run: {chosen}"
    )
    for kind in sessions:
        cells = [f"{'whole' if s is None else s}: {1e3 * best[kind, s]:.0f} ms" for s in sizes]
        print(f"  {kind:8s} " + ", ".join(cells))


if __name__ == "__main__":
    main()
