"""Cost of models: parameters, multiply-adds (``torch.utils.flop_counter``), latency and peak
memory."""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode


def count_parameters(model: nn.Module) -> int:
    """Parameters of a model; for a `HydraModel`, without the padding of ragged head counts."""
    counter = getattr(model, "num_parameters", None)
    if callable(counter) and hasattr(model, "head_sets"):
        return int(counter(effective=True))
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def multiply_adds(run: Callable[[], Any]) -> int:
    """Multiply-adds of one call of ``run`` (FLOPs / 2 as counted by PyTorch's flop counter)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops() // 2


def synchronizer(device: str | torch.device) -> Callable[[], None]:
    """What waits for ``device`` to finish queued work (nothing on CPU), for honest timings."""
    device = torch.device(device)
    if device.type == "cuda":
        return partial(torch.cuda.synchronize, device)
    return lambda: None


@torch.inference_mode()
def interleaved_latency(
    runs: dict[str, Callable[[], Any]],
    repeats: int = 10,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call for each of ``runs``, timed round-robin (A B C A B C ...).

    Interleaving spreads machine noise evenly over the candidates, so their ratios are fair.
    ``sync`` waits for an asynchronous device (`synchronizer`) before and after each call.
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for run in runs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    runs: dict[str, Callable[[], Any]],
    repeats: int = 10,
    warmup: int = 2,
    sync: Callable[[], None] | None = None,
    count_macs: bool = True,
) -> dict[str, dict[str, float]]:
    """The cost of each of ``runs`` (name -> one call), measured side by side: ``median_ms`` and
    ``p90_ms`` per call over ``repeats`` interleaved rounds (`interleaved_latency`) and, with
    ``count_macs``, ``gmacs``, the multiply-adds of one call in billions."""
    times = interleaved_latency(runs, repeats=repeats, warmup=warmup, sync=sync)
    measured = {
        name: {"median_ms": 1e3 * median(values), "p90_ms": 1e3 * percentile(values, 0.9)}
        for name, values in times.items()
    }
    if count_macs:
        with torch.inference_mode():
            for name, run in runs.items():
                measured[name]["gmacs"] = multiply_adds(run) / 1e9
    return measured


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
