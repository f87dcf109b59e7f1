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
