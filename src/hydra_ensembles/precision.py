"""One place that decides the compute precision for a device.

``precision="auto"`` picks bf16 only where it is native, and decides the same way every time on
one machine:

* CPU: the CPU's flags decide where they are unambiguous. AMX or AVX-512 BF16 (``/proc/cpuinfo``)
  computes bf16 natively: bf16. Known flags without either: bf16 would be emulated, 15-100x
  slower than fp32 (a 512x512 matmul: 1.4 vs 150 GFLOP/s on an AVX2-only EPYC): fp32. Only where
  the flags cannot be read (another OS, another architecture) does a timed matmul probe decide:
  interleaved rounds, the median ratio, bf16 only at `PROBE_SPEEDUP` x fp32's speed or more; its
  result is cached per machine (`runtime.machine_cache_path`), so later processes do not measure again.
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
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InputError
from .runtime import cpu_info, machine_measurement

if TYPE_CHECKING:
    import torch

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Each precision's torch dtype, by name (`dtype_of`): this module imports torch only when it
computes, so the command line's ``--precision`` costs no torch import."""
PRECISION_ENV = "HYDRA_PRECISION"
CPU_BF16_ENV = "HYDRA_CPU_BF16"
PROBE_SPEEDUP = 1.25
"""bf16 must be at least this much faster than fp32 in the probe (median of its rounds) to be
chosen: a margin over the probe's round-to-round noise, so a busy machine does not flip the
decision."""


@dataclass(frozen=True)
class Precision:
    """A resolved precision: its name (``fp32|bf16|fp16``) and why it was chosen."""

    name: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.name)

    @property
    def dtype_name(self) -> str:
        """The torch dtype's name: ``float32``, ``bfloat16`` or ``float16``."""
        return DTYPE_NAMES[self.name]

    @property
    def reduced(self) -> bool:
        """True for bf16 and fp16 (autocast on), False for fp32."""
        return self.name != "fp32"

    def autocast(self, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
        """Autocast to this precision on ``device`` (a no-op for fp32)."""
        import torch

        device_type = torch.device(device).type
        if not self.reduced:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of the precision ``name`` (``fp32|bf16|fp16``)."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


def check_precision(precision: str) -> str:
    """``precision`` if it is one of `PRECISIONS`, else a ValueError naming them."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def resolve_precision(precision: str | Precision = "auto", device: str | torch.device = "cpu") -> Precision:
    """The precision to compute in on ``device`` (see the module docstring for the rules)."""
    if isinstance(precision, Precision):
        return precision
    import torch

    check_precision(precision)
    device = torch.device(device)
    if precision == "auto":
        forced = os.environ.get(PRECISION_ENV)
        if forced:
            if forced not in DTYPE_NAMES:
                raise InputError(f"{PRECISION_ENV}={forced!r}: choose one of {tuple(DTYPE_NAMES)}")
            return Precision(forced, f"set by {PRECISION_ENV}")
        return _auto(device)
    if device.type == "cpu" and precision != "fp32":
        native, why = cpu_bf16_support() if precision == "bf16" else (False, "fp16 is emulated on CPUs")
        if native is False:
            warnings.warn(
                f"{precision} requested, but {why}: expect it to be much slower than fp32", stacklevel=2
            )
            return Precision(precision, f"requested; {why}")
    return Precision(precision, "requested")


def _auto(device: torch.device) -> Precision:
    import torch

    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", f"auto: {torch.cuda.get_device_name(device)} supports bf16")
        return Precision("fp16", f"auto: {torch.cuda.get_device_name(device)} has no bf16")
    if device.type != "cpu":
        return Precision("fp32", f"auto: no reduced-precision rule for {device.type}")
    native, why = cpu_bf16_support()
    if native is None:  # flags unknown: the (cached) probe decides
        speedup = cpu_bf16_speedup()
        if speedup < PROBE_SPEEDUP:
            return Precision("fp32", f"auto: {why}; bf16 measured {speedup:.2f}x fp32's matmul speed")
        return Precision("bf16", f"auto: {why}; bf16 measured {speedup:.1f}x fp32's matmul speed")
    return Precision("bf16" if native else "fp32", f"auto: {why}")


def cpu_bf16_support() -> tuple[bool | None, str]:
    """Whether this CPU computes bf16 natively (None: its flags are unknown), and why, in words."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None:
        if forced not in ("native", "emulated"):
            raise InputError(f"{CPU_BF16_ENV}={forced!r}: choose 'native' or 'emulated'")
        return forced == "native", f"bf16 forced {forced} by {CPU_BF16_ENV}"
    _, flags = cpu_info()
    if "amx_bf16" in flags:
        return True, "this CPU has AMX (native bf16)"
    if "avx512_bf16" in flags:
        return True, "this CPU has AVX-512 BF16 (native bf16)"
    if flags:
        return False, "this CPU has no native bf16 (no AVX-512 BF16 or AMX)"
    return None, "this CPU's flags are unknown"


@functools.cache
def cpu_bf16_speedup() -> float:
    """fp32 time / bf16 time of the matmul probe on this machine: measured once
    (`measure_bf16_speedup`) and kept with the machine's other measurements
    (`runtime.machine_measurement`)."""
    return float(machine_measurement("bf16 matmul speedup", lambda: measure_bf16_speedup()))


def measure_bf16_speedup(size: int = 512, rounds: int = 7, repeats: int = 3) -> float:
    """fp32 time / bf16 time of a ``size``-square matmul: ``rounds`` interleaved rounds (fp32 then
    bf16, each the best of ``repeats`` runs), the median of the rounds' ratios, so one slow run on
    a busy machine cannot decide alone. Three rounds in which bf16 is 10x slower or worse end the
    probe early (emulated: no need to measure it precisely)."""
    import torch

    pairs = {dtype: (torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    for a, b in pairs.values():
        a @ b  # warm-up: first-call dispatch and allocation

    def best(dtype: torch.dtype) -> float:
        a, b = pairs[dtype]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times)

    ratios = []
    for _ in range(rounds):
        fp32, bf16 = best(torch.float32), best(torch.bfloat16)
        ratios.append(fp32 / bf16)
        if len(ratios) >= 3 and max(ratios) < 0.1:
            break
    return statistics.median(ratios)


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
    import torch

    first = model[0] if isinstance(model, list | tuple) else model
    try:
        return next(first.parameters()).device
    except StopIteration:
        return torch.device("cpu")
