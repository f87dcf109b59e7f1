"""One place that decides the compute precision for a device.

``precision="auto"`` picks bf16 only where it is native and measured faster than fp32:

* CPU: bf16 needs AMX or AVX-512 BF16 (``/proc/cpuinfo`` flags); without them it is emulated and
  runs 15-100x slower than fp32 (a 512x512 matmul: 1.4 vs 150 GFLOP/s on an AVX2-only EPYC). With
  them, a small timed matmul probe (cached for the process) must confirm bf16 is faster.
* CUDA: bf16 where the GPU supports it, else fp16.
* anything else: fp32.

Explicit ``"fp32"``, ``"bf16"`` and ``"fp16"`` are used as given (with a warning where the CPU
would emulate them). Environment overrides, for tests and for users who know better:
``HYDRA_PRECISION`` (``fp32|bf16|fp16``) replaces ``"auto"``; ``HYDRA_CPU_BF16`` (``native`` or
``emulated``) replaces what the CPU flags and the probe say.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from dataclasses import dataclass

import torch

from .runtime import cpu_info

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_ENV = "HYDRA_PRECISION"
CPU_BF16_ENV = "HYDRA_CPU_BF16"
PROBE_SPEEDUP = 1.1
"""bf16 must be at least this much faster than fp32 in the probe to be chosen."""


@dataclass(frozen=True)
class Precision:
    """A resolved precision: its name (``fp32|bf16|fp16``) and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def dtype_name(self) -> str:
        """The torch dtype's name: ``float32``, ``bfloat16`` or ``float16``."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def reduced(self) -> bool:
        """True for bf16 and fp16 (autocast on), False for fp32."""
        return self.name != "fp32"

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """Autocast to this precision on ``device`` (a no-op for fp32)."""
        device_type = torch.device(device).type
        if not self.reduced:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def check_precision(precision: str) -> str:
    """``precision`` if it is one of `PRECISIONS`, else a ValueError naming them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def resolve_precision(precision: str | Precision = "auto", device: str | torch.device = "cpu") -> Precision:
    """The precision to compute in on ``device`` (see the module docstring for the rules)."""
    if isinstance(precision, Precision):
        return precision
    check_precision(precision)
    device = torch.device(device)
    if precision == "auto":
        forced = os.environ.get(PRECISION_ENV)
        if forced:
            if forced not in DTYPES:
                raise ValueError(f"{PRECISION_ENV}={forced!r}: choose one of {tuple(DTYPES)}")
            return Precision(forced, f"set by {PRECISION_ENV}")
        return _auto(device)
    if device.type == "cpu" and precision != "fp32":
        native, why = cpu_bf16_support() if precision == "bf16" else (False, "fp16 is emulated on CPUs")
        if not native:
            warnings.warn(
                f"{precision} requested, but {why}: expect it to be much slower than fp32", stacklevel=2
            )
            return Precision(precision, f"requested; {why}")
    return Precision(precision, "requested")


def _auto(device: torch.device) -> Precision:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", f"auto: {torch.cuda.get_device_name(device)} supports bf16")
        return Precision("fp16", f"auto: {torch.cuda.get_device_name(device)} has no bf16")
    if device.type != "cpu":
        return Precision("fp32", f"auto: no reduced-precision rule for {device.type}")
    native, why = cpu_bf16_support()
    if not native:
        return Precision("fp32", f"auto: {why}")
    speedup = _cpu_bf16_speedup() if CPU_BF16_ENV not in os.environ else None
    if speedup is not None and speedup < PROBE_SPEEDUP:
        return Precision("fp32", f"auto: {why}, but bf16 measured only {speedup:.2f}x fp32's speed")
    measured = "" if speedup is None else f", {speedup:.1f}x fp32's matmul speed"
    return Precision("bf16", f"auto: {why}{measured}")


def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and the reason in words."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None:
        if forced not in ("native", "emulated"):
            raise ValueError(f"{CPU_BF16_ENV}={forced!r}: choose 'native' or 'emulated'")
        return forced == "native", f"bf16 forced {forced} by {CPU_BF16_ENV}"
    _, flags = cpu_info()
    if "amx_bf16" in flags:
        return True, "this CPU has AMX (native bf16)"
    if "avx512_bf16" in flags:
        return True, "this CPU has AVX-512 BF16 (native bf16)"
    if flags:
        return False, "this CPU has no native bf16 (no AVX-512 BF16 or AMX)"
    return True, "this CPU's flags are unknown; the probe decides"


@functools.cache
def _cpu_bf16_speedup(size: int = 512, seconds: float = 0.05) -> float:
    """fp32 time / bf16 time of a ``size``-square matmul (best of repeated runs), once per process."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        a @ b
        times, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(times) < 3:
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
            if times[-1] > 10 * seconds:  # emulated: one run says enough
                break
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


def in_precision(model: torch.nn.Module, precision: Precision) -> torch.nn.Module:
    """``model`` itself where its floating-point weights already have ``precision``'s dtype, else a
    copy cast to it (for work that runs many forward passes, e.g. circuit extraction, where a cast
    copy is faster than autocasting every op)."""
    import copy

    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes <= {precision.dtype}:
        return model
    return copy.deepcopy(model).to(precision.dtype)


def model_device(model) -> torch.device:
    """The device of a model's (or the first of a list of models') first parameter."""
    first = model[0] if isinstance(model, list | tuple) else model
    try:
        return next(first.parameters()).device
    except StopIteration:
        return torch.device("cpu")
