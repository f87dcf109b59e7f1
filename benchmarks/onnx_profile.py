"""Where the exported fused graph spends its time in onnxruntime, beside the fused PyTorch model.

The real MiniLM-L6, M members keeping ``--keep`` of 12 heads per layer (random, seed 0), fused and
exported as ``hydra-ens export`` exports it and run with its settings (`serving.onnx_ops`; the
batch in one run); random token ids of ``--tokens`` tokens. Prints the latency of the graph and
of the fused model in PyTorch (best of ``--repeats`` runs after a warm-up, the two alternating),
then onnxruntime's profile: time per operator type per run.
``--float16`` also times the graph converted to float16 by onnxruntime's converter (inputs and
outputs kept as they are) and prints how far its logits are from the float32 graph's.

``--kernels`` also times, alone, each matrix-product shape of the fused model in onnxruntime and in
PyTorch, and the residual Add + LayerNorm with and without onnxruntime's SkipLayerNormalization.

    python benchmarks/onnx_profile.py [--batch 8] [--tokens 128] [--members 3] [--keep 8] \\
        [--float16] [--kernels]
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import onnxruntime
import torch

import hydra_ensembles as he
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.runtime import describe_machine
from hydra_ensembles.serving.onnx import ONNX_NAME, export_onnx
from hydra_ensembles.serving.onnx_ops import DISABLED_OPTIMIZERS, inference_session, session_options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="operator types listed")
    parser.add_argument("--float16", action="store_true", help="also time the graph in float16")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also time the graph's matrix-product shapes and its residual Add + LayerNorm alone, "
        "in onnxruntime and in PyTorch",
    )
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
        options = session_options()  # as served (`serving.onnx_ops`), with the profiler on
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "profile")
        session = inference_session(str(graph), options)
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
    if args.kernels:
        hidden, width = base.config.hidden_size, base.config.intermediate_size
        rows = args.batch * args.tokens
        heads = args.keep * hidden // base.config.num_attention_heads
        per_member, merged = [(hidden, 3 * heads), (heads, hidden)], [(hidden, width), (width, hidden)]
        _kernel_lines(rows, per_member, merged, args.members)


def _best_ms(run, repeats: int = 20) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _kernel_lines(rows: int, per_member: list, merged: list, members: int) -> None:
    """One matrix product (+ bias) of each shape the fused model runs (a member's projections on
    its rows; the shared MLP on all members' rows), in onnxruntime and PyTorch; and the residual
    Add + LayerNorm with and without onnxruntime's SkipLayerNormalization fusion."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def session(nodes, inputs, output, weights, disabled=()):
        graph = helper.make_graph(nodes, "g", inputs, [output], weights)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
        return onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"], disabled_optimizers=list(disabled)
        )

    g = np.random.default_rng(0)
    print("matrix products (+ bias), best of 20: onnxruntime vs PyTorch")
    shapes = [(rows, k, n) for k, n in per_member] + [(members * rows, k, n) for k, n in merged]
    for m, k, n in shapes:
        x = g.standard_normal((m, k), dtype=np.float32)
        w = g.standard_normal((k, n), dtype=np.float32) * 0.05
        b = g.standard_normal(n, dtype=np.float32)
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
        ort = session(
            nodes,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n]),
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
        )
        tx, tw, tb = torch.from_numpy(x), torch.from_numpy(np.ascontiguousarray(w.T)), torch.from_numpy(b)
        ort_ms = _best_ms(partial(ort.run, None, {"x": x}))
        with torch.no_grad():
            torch_ms = _best_ms(partial(torch.nn.functional.linear, tx, tw, tb))
        print(f"  {m} x {k} x {n}: {ort_ms:.2f} ms vs {torch_ms:.2f} ms ({ort_ms / torch_ms:.2f}x)")
    hidden = per_member[0][0]
    shape = [members * rows // 128, 128, hidden]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12),
    ]
    norm = [numpy_helper.from_array(np.ones(hidden, np.float32), n) for n in ("gamma", "beta")]
    feed = {n: g.standard_normal(shape, dtype=np.float32) for n in ("x", "r")}
    ways = (("fused (SkipLayerNormalization)", ()), ("Add + LayerNormalization", DISABLED_OPTIMIZERS))
    for label, disabled in ways:
        ort = session(nodes, [value("x"), value("r")], value("y"), norm, disabled)
        ms = _best_ms(partial(ort.run, None, feed))
        print(f"residual Add + LayerNorm on {shape}, {label}: {ms:.2f} ms")


def _float16_line(graph: Path, feed: dict, reference: list, repeats: int) -> str:
    """The float16 graph's latency (best of ``repeats``) and its largest logit difference."""
    import numpy as np
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    half = convert_float_to_float16(onnx.load(str(graph)), keep_io_types=True)
    session = inference_session(half.SerializeToString())
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
