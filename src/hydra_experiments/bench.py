"""`hydra-ens bench`: the cost of Single, Deep Ensemble, members one by one, the fused model and
the other one-model ensembles (BatchEnsemble, Packed-Ensembles).

For one model and Hydra configuration: median and p90 latency per batch at several batch sizes,
whole-test-set time, parameters, multiply-adds (``torch.utils.flop_counter``) and peak tensor
memory (on a GPU: the allocator's peak), in fp32 and in the reduced precision ``auto`` picks on
the device, if any (`precision.resolve_precision`). Runs are interleaved (A B C D A B C D ...)
after warm-up, so the ratios to Single compare like with like on a noisy machine. Every method can
be timed compiled (``torch.compile``; ``reduce-overhead`` replays CUDA graphs on a GPU).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hydra_ensembles.baselines.batch_ensemble import batch_ensemble
from hydra_ensembles.baselines.packed import PACKED_KEY, packed_ensemble
from hydra_ensembles.batching import on_device
from hydra_ensembles.cost import count_parameters, interleaved_latency, measure, multiply_adds, synchronizer
from hydra_ensembles.errors import InputError
from hydra_ensembles.fusion import fuse
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.models import VISION_MODEL_TYPES
from hydra_ensembles.precision import resolve_precision
from hydra_ensembles.reporting import markdown_table
from hydra_ensembles.surgery import prune


class _PeakMemory(TorchDispatchMode):
    """Tracks the bytes of tensor storages created during a region, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    size = storage.nbytes()
                    self._seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._release, key, size)
        return out


@torch.inference_mode()
def peak_memory(run: Callable[[], Any], device: str | torch.device = "cpu") -> int:
    """Peak bytes of tensors allocated by ``run`` (weights that existed before are not counted):
    on a GPU the CUDA allocator's peak over what was allocated before; elsewhere the storages
    created during the run, tracked as they are created and freed."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    with _PeakMemory() as tracker:
        run()
    return tracker.peak


def random_inputs(config: Any, tokens: int, seed: int) -> Callable[[int], dict[str, torch.Tensor]]:
    """``batch`` -> random inputs for an encoder of ``config``: images of its size, or ``tokens``
    random token ids past the special tokens of a real vocabulary (one seeded stream); ValueError
    (when inputs are first made) for more tokens than the model has positions."""
    generator = torch.Generator().manual_seed(seed)

    def make(batch: int) -> dict[str, torch.Tensor]:
        if config.model_type in VISION_MODEL_TYPES:
            size = config.image_size
            return {"pixel_values": torch.randn(batch, config.num_channels, size, size, generator=generator)}
        positions = getattr(config, "max_position_embeddings", None)
        if isinstance(positions, int) and tokens > positions:
            raise InputError(f"--tokens {tokens} exceeds the model's {positions} positions")
        low = min(1000, config.vocab_size // 2)
        ids = torch.randint(low, config.vocab_size, (batch, tokens), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return make


def _each(run: Callable[[dict], Any], chunks: list[dict]) -> list:
    return [run(c) for c in chunks]


def run_bench(
    model: torch.nn.Module,
    head_sets: Sequence[HeadSet],
    make_inputs: Callable[[int], dict[str, torch.Tensor]],
    batch_sizes: Sequence[int] = (1, 8, 64),
    dtypes: Sequence[str] | None = None,
    repeats: int = 10,
    test_set: int = 0,
    test_batch: int = 64,
    progress: Callable[[str], None] = print,
    device: str | torch.device = "cpu",
    onnx: bool = False,
    trunk_head_sets: Sequence[HeadSet] | None = None,
    methods: Sequence[str] | None = None,
    compile_mode: str | None = None,
) -> dict[str, Any]:
    """Measure every method on ``device``; ``make_inputs(batch)`` builds one input batch (on CPU).
    ``dtypes`` (torch dtype names): default float32, plus the reduced precision ``auto`` picks on
    ``device``. ``onnx``: also the fused model run by onnxruntime (float32, CPU; peak memory not
    measured). ``trunk_head_sets``: members sharing their first layers, timed as `SHARED_TRUNK`.
    ``methods``: keys of `METHODS` (default all; Single always). ``compile_mode``: every model
    ``torch.compile``d in this mode, static shapes (multiply-adds counted eagerly)."""
    device = torch.device(device)
    chosen = _chosen_methods(methods, trunk_head_sets is not None)
    if dtypes is None:
        auto = resolve_precision("auto", device)
        dtypes = ["float32"] + ([auto.dtype_name] if auto.reduced else [])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device cuda requested, but torch sees no CUDA GPU")
    results: dict[str, Any] = {
        "batch_sizes": list(batch_sizes),
        "dtypes": {},
        "device": str(device),
        "compile": compile_mode,
    }
    warmup = 2 if compile_mode is None else 4  # compiling, then recording CUDA graphs, take calls
    setting = _Setting(
        partial(_inputs_on, make_inputs, device), repeats, synchronizer(device), progress, device, warmup
    )
    built: dict[str, dict[str, Callable[[dict], Any]]] = {}
    with _compile_limits(compile_mode):  # compiling happens at the first timed calls
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            with_onnx = onnx and dtype == torch.float32 and device.type == "cpu"
            eager, params = _build_methods(
                model, head_sets, dtype, device, with_onnx, setting.inputs(1), trunk_head_sets, chosen
            )
            methods = _compiled(eager, compile_mode)
            if PACKED in eager:
                results["packed_alpha"] = getattr(eager[PACKED].models[0].config, PACKED_KEY)["alpha"]
            built[dtype_name] = methods
            table = _dtype_table(methods, eager, params, batch_sizes, setting, dtype_name)
            if test_set:
                progress(f"[{dtype_name}] whole test set: {test_set} inputs in batches of {test_batch}")
                for name, seconds in _test_set_seconds(methods, setting, test_set, test_batch).items():
                    table[name]["test_set_s"] = seconds
            results["dtypes"][dtype_name] = table
        if {"float32", "bfloat16"} <= set(built) and HYDRA in chosen:
            results["hydra_bf16_vs_single_fp32"] = _bf16_vs_fp32(built, max(batch_sizes), setting)
    return results


def _test_set_seconds(
    methods: dict[str, Callable[[dict], Any]], setting: _Setting, inputs: int, batch: int
) -> dict[str, float]:
    """Seconds each method takes over ``inputs`` random inputs in batches of ``batch`` (once,
    interleaved)."""
    sizes = [min(batch, inputs - i) for i in range(0, inputs, batch)]
    chunks = [setting.inputs(n) for n in sizes]
    runs = {n: partial(_each, f, chunks) for n, f in methods.items()}
    totals = interleaved_latency(runs, repeats=1, warmup=0, sync=setting.sync)
    return {name: values[0] for name, values in totals.items()}


SINGLE, DEEP, MEMBERS, HYDRA = "Single", "Deep Ensemble", "Members one by one", "Hydra (fused)"
SHARED_TRUNK, BATCH_ENSEMBLE, PACKED = "Hydra (shared trunk)", "BatchEnsemble", "Packed-Ensembles"
METHODS = {
    "single": SINGLE,
    "deep-ensemble": DEEP,
    "members": MEMBERS,
    "hydra": HYDRA,
    "trunk": SHARED_TRUNK,
    "batch-ensemble": BATCH_ENSEMBLE,
    "packed": PACKED,
}
"""The methods `run_bench` can time: key (as ``hydra-ens bench --methods`` names it) -> row name."""
PACKED_ALPHA = 2
"""Packed-Ensembles' width factor in the benchmark (Laurent et al.'s usual alpha = 2, gamma = 1);
where the widened heads do not split into M members, alpha = M (members as wide as the model)."""


def packed_model(model: torch.nn.Module, members: int) -> torch.nn.Module:
    """The Packed-Ensemble the benchmark times: ``PACKED_ALPHA`` times as wide as ``model``, or
    ``members`` times where that width does not split into ``members`` members; its alpha is
    recorded in its config (`baselines.packed.PACKED_KEY`)."""
    try:
        return packed_ensemble(model, members, alpha=PACKED_ALPHA).eval()
    except InputError:
        return packed_ensemble(model, members, alpha=members).eval()


def _chosen_methods(methods: Sequence[str] | None, with_trunk: bool) -> list[str]:
    """The row names to time, in `METHODS`' order; InputError for an unknown key, or for the
    shared-trunk row without trunk head sets."""
    keys = list(METHODS) if methods is None else list(methods)
    unknown = [k for k in keys if k not in METHODS]
    if unknown:
        raise InputError(f"unknown bench method(s) {', '.join(unknown)}: choose from {', '.join(METHODS)}")
    if methods is not None and "trunk" in keys and not with_trunk:
        raise InputError("the shared-trunk method needs --shared-layers K (K > 0)")
    if methods is None and not with_trunk:
        keys.remove("trunk")
    return [name for key, name in METHODS.items() if key in keys or key == "single"]


def _compiled(methods: dict[str, Callable[[dict], Any]], mode: str | None) -> dict[str, Callable]:
    """``methods`` with every PyTorch model in them compiled in ``mode`` (None: as they are)."""
    if mode is None:
        return methods
    compile_ = partial(torch.compile, mode=mode, dynamic=False)
    return {
        name: run if isinstance(run, GraphRun) else _ModelsRun([compile_(m) for m in run.models])
        for name, run in methods.items()
    }


RECOMPILE_LIMIT = 64
"""Compilations torch.compile may make of one function while the benchmark compiles: every model
is its own instance of the same classes, at every batch size, and dynamo's default (8) would
leave the models compiled after the limit running eagerly, their times mislabelled."""


def _compile_limits(mode: str | None):
    """While models are compiled in ``mode``: dynamo's recompilation limits raised to
    `RECOMPILE_LIMIT` (nothing changes without ``mode``)."""
    import contextlib

    if mode is None:
        return contextlib.nullcontext()
    import torch._dynamo.config as dynamo

    return dynamo.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=16 * RECOMPILE_LIMIT)


class _ModelsRun:
    """One method of the benchmark: its models, called one after another on the same inputs (one
    model: its output; several: the list of their outputs)."""

    def __init__(self, models: Sequence[Callable[..., Any]]) -> None:
        self.models = list(models)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> Any:
        if len(self.models) == 1:
            return self.models[0](**inputs)
        return [m(**inputs) for m in self.models]


@dataclass(frozen=True)
class _Setting:
    """How every timing of one benchmark runs: its inputs, rounds, device sync and progress."""

    inputs: Callable[[int], dict]
    repeats: int
    sync: Callable[[], None]
    progress: Callable[[str], None]
    device: torch.device
    warmup: int


def _dtype_table(
    methods: dict[str, Callable[[dict], Any]],
    eager: dict[str, Callable[[dict], Any]],
    params: dict[str, int],
    batch_sizes: Sequence[int],
    setting: _Setting,
    dtype_name: str,
) -> dict[str, Any]:
    """One dtype's table: parameters, multiply-adds per input (of the ``eager`` methods), latency
    per batch size of the timed ``methods`` (and its ratio to Single's), peak memory at the
    largest batch."""
    one = setting.inputs(1)
    macs = {name: multiply_adds(partial(f, one)) for name, f in eager.items() if ORT not in name}
    for name in methods:  # the same graph; torch's counter does not see onnxruntime
        if ORT in name:
            macs[name] = macs[name.partition(ORT)[0]]
    table: dict[str, Any] = {
        name: {"params": params[name], "gmacs_per_input": macs[name] / 1e9, "latency": {}} for name in methods
    }
    for batch in batch_sizes:
        rounds = f"{len(methods)} methods x {setting.repeats} interleaved runs"
        setting.progress(f"[{dtype_name}] batch {batch}: timing {rounds}")
        x = setting.inputs(batch)
        runs = {n: partial(f, x) for n, f in methods.items()}
        timed = measure(runs, setting.repeats, setting.warmup, sync=setting.sync, count_macs=False)
        for name, cost in timed.items():
            table[name]["latency"][str(batch)] = cost
        if batch == max(batch_sizes):
            for name, f in methods.items():
                if isinstance(f, GraphRun):  # onnxruntime allocates outside torch
                    peak = f.peak_bytes(x)
                    if peak is not None:
                        table[name]["peak_memory_mb"] = peak / 2**20
                elif f is eager[name]:  # compiled: CUDA graphs keep their memory in a pool of their own
                    table[name]["peak_memory_mb"] = peak_memory(partial(f, x), setting.device) / 2**20
    single = table[SINGLE]["latency"]
    for row in table.values():
        row["latency_vs_single"] = {
            b: row["latency"][b]["median_ms"] / single[b]["median_ms"] for b in row["latency"]
        }
    return table


def _bf16_vs_fp32(built: dict[str, dict[str, Callable]], batch: int, setting: _Setting) -> dict[str, Any]:
    """Hydra in bfloat16 timed against Single in float32, side by side."""
    setting.progress(f"Hydra bf16 vs Single fp32, batch {batch}: {setting.repeats} interleaved runs")
    x = setting.inputs(batch)
    runs = {
        "Single float32": partial(built["float32"][SINGLE], x),
        "Hydra (fused) bfloat16": partial(built["bfloat16"][HYDRA], x),
    }
    measured = measure(runs, setting.repeats, setting.warmup, sync=setting.sync, count_macs=False)
    return {"batch": batch, **{f"{name} median_ms": cost["median_ms"] for name, cost in measured.items()}}


def _inputs_on(make_inputs: Callable[[int], dict], device: torch.device, batch: int) -> dict:
    return on_device(make_inputs(batch), device)


def _build_methods(
    model: torch.nn.Module,
    head_sets: Sequence[HeadSet],
    dtype: torch.dtype,
    device: torch.device,
    onnx: bool = False,
    example: dict[str, torch.Tensor] | None = None,
    trunk_head_sets: Sequence[HeadSet] | None = None,
    chosen: Sequence[str] = (SINGLE, DEEP, MEMBERS, HYDRA, BATCH_ENSEMBLE, PACKED),
) -> tuple[dict[str, Callable[[dict], Any]], dict[str, int]]:
    """The ``chosen`` methods of the benchmark in ``dtype`` on ``device``, and their parameters.

    BatchEnsemble (M members in one model, all of them computed on M x B rows) and
    Packed-Ensembles (M narrow members side by side in one model ``PACKED_ALPHA`` times as wide,
    from a random start) are timed beside them as the other one-model ensembles; with ``onnx``,
    the fused model run by onnxruntime, with the inputs named as in ``example``."""
    single = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    m = len(head_sets)
    builders: dict[str, Callable[[], list[torch.nn.Module]]] = {
        SINGLE: lambda: [single],
        DEEP: lambda: [single] + [copy.deepcopy(single) for _ in range(m - 1)],
        MEMBERS: lambda: [prune(single, hs).eval() for hs in head_sets],
        HYDRA: lambda: [fuse(single, head_sets).eval()],
        SHARED_TRUNK: lambda: [fuse(single, trunk_head_sets).eval()],
        BATCH_ENSEMBLE: lambda: [batch_ensemble(single, m).eval()],
        PACKED: lambda: [packed_model(single, m)],
    }
    built = {name: builders[name]() for name in chosen}
    methods: dict[str, Callable[[dict], Any]] = {name: _ModelsRun(models) for name, models in built.items()}
    params = {name: sum(count_parameters(x) for x in models) for name, models in built.items()}
    if onnx:
        names = list(example or {})
        for name in (SINGLE, HYDRA):
            if name in built:
                fp32, int8 = _onnxruntime_methods(built[name][0], names, example)
                methods[f"{name}{ORT}"], methods[f"{name}{ORT} int8"] = fp32, int8
                params[f"{name}{ORT}"] = params[f"{name}{ORT} int8"] = params[name]
    return methods, params


ORT = " onnxruntime"
"""What the names of the methods run by onnxruntime end in (after the PyTorch method's name)."""


def _onnxruntime_methods(
    model: torch.nn.Module, input_names: list[str], example: dict[str, torch.Tensor]
) -> tuple[GraphRun, GraphRun]:
    """``model`` exported (and checked against PyTorch) and loaded into onnxruntime, as float32
    and int8 (`serving.quantization.quantize_int8`, as ``export --quantize int8``, its activation
    scales fixed on ``example``)."""
    import json
    import tempfile

    from hydra_ensembles.serving.onnx import ONNX_NAME, SIDECAR_NAME, export_onnx
    from hydra_ensembles.serving.quantization import graph_feeds, quantize_int8

    with tempfile.TemporaryDirectory() as folder:
        written = export_onnx(model, Path(folder) / "onnx", input_names=input_names)
        graph = (written / ONNX_NAME).read_bytes()
        settings = json.loads((written / SIDECAR_NAME).read_text())["onnxruntime"]
    feeds = graph_feeds([{name: example[name].cpu() for name in input_names}], input_names)
    return GraphRun(graph, settings), GraphRun(quantize_int8(graph, feeds), settings)


class GraphRun:
    """An exported graph in onnxruntime, run as served (`serving.onnx_ops`: the sidecar's runs in
    pieces and disabled fusion), called on a batch of PyTorch inputs. Its session's threads stop
    spin-waiting when a run returns, so that they leave the cores to the methods timed after it."""

    def __init__(self, weights: bytes, settings: dict[str, Any]) -> None:
        from hydra_ensembles.serving.onnx_ops import inference_session, session_options

        self.weights, self.settings = weights, settings
        self.session = inference_session(weights, session_options(idle_spin=False))

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list:
        from hydra_ensembles.serving.onnx_ops import run_session

        return run_session(self.session, {k: v.numpy() for k, v in inputs.items()}, self.settings)

    def peak_bytes(self, inputs: dict[str, torch.Tensor]) -> int | None:
        """The memory one run on ``inputs`` adds to a fresh process holding a session of the graph
        (the weights, loaded before, are not counted); None where it cannot be read."""
        import json
        import subprocess
        import sys
        import tempfile

        import numpy as np

        with tempfile.TemporaryDirectory() as folder:
            graph, feed = Path(folder) / "model.onnx", Path(folder) / "inputs.npz"
            graph.write_bytes(self.weights)
            np.savez(feed, **{k: v.numpy() for k, v in inputs.items()})
            setup = [str(graph), str(feed), json.dumps(self.settings)]
            done = subprocess.run(
                [sys.executable, "-c", _PEAK_CHILD, *setup], capture_output=True, text=True, check=False
            )
        try:
            return int(done.stdout.split()[-1])
        except (IndexError, ValueError):
            return None


_PEAK_CHILD = """
import json, os, sys
import numpy as np
from hydra_ensembles.serving.onnx_ops import inference_session, run_session
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
session, feed = inference_session(sys.argv[1]), dict(np.load(sys.argv[2]))
loaded = resident()
run_session(session, feed, json.loads(sys.argv[3]))
print(resident() - loaded)
"""
"""Run in a fresh process by `GraphRun.peak_bytes`: onnxruntime's arena keeps the memory a run
needed, so the resident size after the run less before it is that run's peak (Linux)."""


def check_targets(results: dict[str, Any]) -> list[str]:
    """The cost targets, each as a line saying met or missed, with the numbers: Hydra / Deep
    Ensemble at the largest batch within the multiply-add ratio + 0.05 and at the smallest batch
    under 0.5 (on a GPU 0.4); on a GPU, Hydra / Single at batch 64 in a reduced precision at most
    1.05 (the paper's 1.07); Hydra in bf16 no slower than Single in fp32."""
    lines = []
    gpu = torch.device(results["device"]).type == "cuda"
    largest, smallest = str(max(results["batch_sizes"])), str(min(results["batch_sizes"]))
    small_target = 0.4 if gpu else 0.5
    for dtype_name, table in results["dtypes"].items():
        if HYDRA not in table:
            continue
        hydra, single = table[HYDRA], table[SINGLE]
        if DEEP in table:
            deep = table[DEEP]
            mac_ratio = hydra["gmacs_per_input"] / deep["gmacs_per_input"]
            big = hydra["latency"][largest]["median_ms"] / deep["latency"][largest]["median_ms"]
            small = hydra["latency"][smallest]["median_ms"] / deep["latency"][smallest]["median_ms"]
            lines.append(
                f"[{dtype_name}] Hydra / Deep Ensemble latency at batch {largest}: {big:.3f} vs multiply-add "
                f"ratio {mac_ratio:.3f} + 0.05 -> {_verdict(big <= mac_ratio + 0.05)}"
            )
            lines.append(
                f"[{dtype_name}] Hydra / Deep Ensemble latency at batch {smallest}: {small:.3f} vs "
                f"{small_target} -> {_verdict(small <= small_target)}"
            )
        if gpu and dtype_name != "float32" and "64" in hydra["latency"]:
            ratio = hydra["latency_vs_single"]["64"]
            macs = hydra["gmacs_per_input"] / single["gmacs_per_input"]
            lines.append(
                f"[{dtype_name}] Hydra / Single latency at batch 64: {ratio:.3f} vs 1.05 (multiply-add "
                f"ratio {macs:.2f}) -> {_verdict(ratio <= 1.05)}"
            )
    cross = results.get("hydra_bf16_vs_single_fp32")
    if cross:
        bf16, fp32 = cross["Hydra (fused) bfloat16 median_ms"], cross["Single float32 median_ms"]
        lines.append(
            f"Hydra bf16 vs Single fp32 at batch {cross['batch']} (interleaved side by side): "
            f"{bf16:.1f} ms vs {fp32:.1f} ms, ratio {bf16 / fp32:.3f} -> {_verdict(bf16 <= fp32)}"
        )
    return lines


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def bench_report(results: dict[str, Any], machine: str, setting: str) -> str:
    """The paper's Table 7 layout: per dtype, latency per batch size, ratios, params, GMAC, memory."""
    parts = ["# Cost benchmark", "", f"- **machine**: {machine}", f"- **setting**: {setting}"]
    if "packed_alpha" in results:
        parts.append(f"- **Packed-Ensembles**: alpha {results['packed_alpha']}, gamma 1, random weights")
    parts.append("")
    batches = [str(b) for b in results["batch_sizes"]]
    for dtype_name, table in results["dtypes"].items():
        headers = (
            ["Method"]
            + [f"b={b} ms (x Single)" for b in batches]
            + ["p90 b=" + batches[-1], "Params (M)", "GMAC / input", "Peak MB (b=" + batches[-1] + ")"]
        )
        if any("test_set_s" in r for r in table.values()):
            headers.append("Test set (s)")
        rows = []
        for name, row in table.items():
            cells = [name] + [
                f"{_ms(row['latency'][b]['median_ms'])} ({row['latency_vs_single'][b]:.2f})" for b in batches
            ]
            cells += [
                _ms(row["latency"][batches[-1]]["p90_ms"]),
                f"{row['params'] / 1e6:.1f}",
                f"{row['gmacs_per_input']:.2f}",
                f"{row['peak_memory_mb']:.0f}" if "peak_memory_mb" in row else "n/a",
            ]
            if "test_set_s" in row:
                cells.append(f"{row['test_set_s']:.1f}")
            rows.append(cells)
        parts += [f"## {dtype_name}", "", markdown_table(headers, rows), ""]
    parts += ["## Targets", ""] + [f"- {line}" for line in check_targets(results)]
    return "\n".join(parts) + "\n"


def _ms(value: float) -> str:
    """Milliseconds to three significant digits or one decimal, whichever is coarser."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"
