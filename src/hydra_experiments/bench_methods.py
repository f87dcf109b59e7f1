"""The methods `hydra-ens bench` times, each built from one model in one dtype: Single, the
deep ensemble (M copies run one by one, the explicit form of a deep ensemble and of a
LoRA-Ensemble alike), the fused deep ensemble and fused LoRA-Ensemble, the pruned members one by
one, the fused Hydra model (and with a shared trunk), BatchEnsemble, Packed-Ensembles, and the
fused models run by onnxruntime."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hydra_ensembles.baselines.batch_ensemble import batch_ensemble
from hydra_ensembles.baselines.lora import lora_parts
from hydra_ensembles.baselines.packed import packed_ensemble
from hydra_ensembles.cost import count_parameters
from hydra_ensembles.errors import InputError
from hydra_ensembles.fusion import fuse
from hydra_ensembles.heads import HeadSet
from hydra_ensembles.surgery import prune

SINGLE, DEEP, MEMBERS, HYDRA = "Single", "Deep Ensemble", "Members one by one", "Hydra (fused)"
DEEP_FUSED, LORA_FUSED = "Deep Ensemble (fused)", "LoRA-Ensemble (fused)"
SHARED_TRUNK, BATCH_ENSEMBLE, PACKED = "Hydra (shared trunk)", "BatchEnsemble", "Packed-Ensembles"
METHODS = {
    "single": SINGLE,
    "deep-ensemble": DEEP,
    "deep-fused": DEEP_FUSED,
    "lora-fused": LORA_FUSED,
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


def chosen_methods(methods: Sequence[str] | None, with_trunk: bool) -> list[str]:
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


def compiled(methods: dict[str, Callable[[dict], Any]], mode: str | None) -> dict[str, Callable]:
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


def compile_limits(mode: str | None):
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


def build_methods(
    model: torch.nn.Module,
    head_sets: Sequence[HeadSet],
    dtype: torch.dtype,
    device: torch.device,
    chosen: Sequence[str] = (SINGLE, DEEP, MEMBERS, HYDRA, BATCH_ENSEMBLE, PACKED),
    trunk_head_sets: Sequence[HeadSet] | None = None,
    onnx_example: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Callable[[dict], Any]], dict[str, int]]:
    """The ``chosen`` methods of the benchmark in ``dtype`` on ``device``, and their parameters.

    The fused deep ensemble and LoRA-Ensemble fuse M members that keep every head
    (`distinct_members`: weights apart everywhere, or only where LoRA trains them), with exact
    per-member parts: what the LoRA members share (MLPs, embeddings, norms) is one module there.

    BatchEnsemble (M members in one model, all of them computed on M x B rows) and
    Packed-Ensembles (M narrow members side by side in one model ``PACKED_ALPHA`` times as wide,
    from a random start) are timed beside them as the other one-model ensembles; with
    ``onnx_example``, Single and the fused model run by onnxruntime too (float32 and int8), fed
    inputs named as in it."""
    single = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    m = len(head_sets)
    builders: dict[str, Callable[[], list[torch.nn.Module]]] = {
        SINGLE: lambda: [single],
        DEEP: lambda: [single] + [copy.deepcopy(single) for _ in range(m - 1)],
        DEEP_FUSED: lambda: [fuse(distinct_members(single, m), mlp="exact").eval()],
        LORA_FUSED: lambda: [fuse(distinct_members(single, m, lora_parts(single)), mlp="exact").eval()],
        MEMBERS: lambda: [prune(single, hs).eval() for hs in head_sets],
        HYDRA: lambda: [fuse(single, head_sets).eval()],
        SHARED_TRUNK: lambda: [fuse(single, trunk_head_sets).eval()],
        BATCH_ENSEMBLE: lambda: [batch_ensemble(single, m).eval()],
        PACKED: lambda: [packed_model(single, m)],
    }
    built = {name: builders[name]() for name in chosen}
    methods: dict[str, Callable[[dict], Any]] = {name: _ModelsRun(models) for name, models in built.items()}
    params = {name: sum(count_parameters(x) for x in models) for name, models in built.items()}
    if onnx_example is not None:
        names = list(onnx_example)
        for name in (SINGLE, HYDRA):
            if name in built:
                fp32, int8 = _onnxruntime_methods(built[name][0], names, onnx_example)
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


def distinct_members(
    model: torch.nn.Module,
    members: int,
    parts: Callable[[str], bool] | None = None,
    seed: int = 0,
    scale: float = 1e-3,
) -> list[torch.nn.Module]:
    """``model`` and ``members - 1`` copies of it as an ensemble's members would be: the copies
    with their parameters perturbed (seeded, by ``scale`` times a normal draw) where ``parts``
    (a parameter's name -> trained) says they trained, everywhere without it, so that fusion
    shares exactly what the members share."""
    generator = torch.Generator().manual_seed(seed)
    copies = [model]
    for _ in range(members - 1):
        member = copy.deepcopy(model)
        with torch.no_grad():
            for name, weight in member.named_parameters():
                if parts is None or parts(name):
                    noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
                    weight.add_(scale * noise.to(device=weight.device, dtype=weight.dtype))
        copies.append(member)
    return copies
