"""Where the exported fused graph spends its time in onnxruntime, beside the fused PyTorch model.

The real MiniLM-L6, M members keeping ``--keep`` of 12 heads per layer (random, seed 0), fused and
exported as ``hydra-ens export`` exports it; random token ids of ``--tokens`` tokens. Prints the
latency of the graph and of the fused model in PyTorch (best of ``--repeats`` runs after a
warm-up, the two alternating), then onnxruntime's profile: time per operator type per run.
``--float16`` also times the graph converted to float16 by onnxruntime's converter (inputs and
outputs kept as they are) and prints how far its logits are from the float32 graph's.

    python benchmarks/onnx_profile.py [--batch 8] [--tokens 128] [--members 3] [--keep 8] [--float16]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import onnxruntime
import torch

import hydra_ensembles as he
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.runtime import describe_machine
from hydra_ensembles.serving.onnx import ONNX_NAME, export_onnx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="operator types listed")
    parser.add_argument("--float16", action="store_true", help="also time the graph in float16")
    args = parser.parse_args()
    offline_by_default()
    torch.manual_seed(0)
    base = load_classifier("minilm-l6", num_labels=4).eval()
    heads = he.sample_members(torch.zeros(6, 12), args.members, heads_per_layer=args.keep, pool_size=12)
    hydra = he.fuse(base, heads).eval()
    names = ["input_ids", "token_type_ids", "attention_mask"]
    ids = torch.randint(1000, base.config.vocab_size, (args.batch, args.tokens))
    inputs = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}
    inputs["attention_mask"] = torch.ones_like(ids)
    feed = {k: v.numpy() for k, v in inputs.items()}
    with tempfile.TemporaryDirectory() as folder:
        graph = export_onnx(hydra, Path(folder) / "onnx", input_names=names) / ONNX_NAME
        options = onnxruntime.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "profile")
        session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        session.run(None, feed)
        with torch.no_grad():
            hydra(**inputs)
            ort_ms, torch_ms = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                session.run(None, feed)
                ort_ms.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                hydra(**inputs)
                torch_ms.append((time.perf_counter() - start) * 1e3)
        events = json.loads(Path(session.end_profiling()).read_text())
        half = _float16_line(graph, feed, session.run(None, feed), args.repeats) if args.float16 else None
    runs = 1 + args.repeats
    per_op = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"] / 1e3 / runs
    total = sum(per_op.values())
    print(f"machine: {describe_machine()}; onnxruntime {onnxruntime.__version__}")
    print(
        f"batch {args.batch} x {args.tokens} tokens, M={args.members}, {args.keep}/12 heads: "
        f"onnxruntime {min(ort_ms):.1f} ms, PyTorch {min(torch_ms):.1f} ms "
        f"({min(ort_ms) / min(torch_ms):.2f}x)"
    )
    print(f"operator time per run in onnxruntime (sum {total:.1f} ms):")
    for op, ms in per_op.most_common(args.top):
        print(f"  {op:26s} {ms:8.1f} ms  {100 * ms / total:5.1f}%")
    if half:
        print(half)


def _float16_line(graph: Path, feed: dict, reference: list, repeats: int) -> str:
    """The float16 graph's latency (best of ``repeats``) and its largest logit difference."""
    import numpy as np
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(onnx.load(str(graph)), keep_io_types=True)
    session = onnxruntime.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, feed)
        times.append((time.perf_counter() - start) * 1e3)
    gap = max(
        float(np.abs(a - b).max()) for a, b in zip(outputs, reference, strict=True) if a.dtype.kind == "f"
    )
    return f"float16 graph: {min(times):.1f} ms; largest output difference from the float32 graph {gap:.1e}"


if __name__ == "__main__":
    main()
