"""Process-level runtime settings that make large CPU batches fast."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = (1 << 31) - 1) -> bool:
    """Keep large tensor buffers on glibc's heap instead of fresh ``mmap`` pages per call.

    By default glibc serves every allocation above a few MB with ``mmap`` and returns it on free,
    so each forward pass page-faults its activations in again. That costs the most where tensors
    are largest, i.e. in a fused model running M members' rows at once (``docs/benchmarks.md``
    has the measurement, from ``benchmarks/fused_latency.py``). The price: freed memory stays
    reserved by the process.
    Returns True when the setting was applied (Linux with glibc), False otherwise.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def describe_machine() -> str:
    """CPU model, cores, bf16/AMX support, torch version and threads, in one line."""
    import os
    import platform

    import torch

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    features = [
        "AMX" if {"amx_bf16", "amx_tile"} & flags else "no AMX",
        "AVX-512 BF16" if "avx512_bf16" in flags else "no AVX-512 BF16",
    ]
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"{model}, {os.cpu_count()} cores ({', '.join(features)}){gpu}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
