"""What this machine is and how to run fast on it: CPU flags, cache size, inference chunking."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from pathlib import Path

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_cpu_allocator(mmap_threshold: int = 256 << 20, trim_threshold: int = 512 << 20) -> bool:
    """Keep large tensor buffers on glibc's heap instead of fresh ``mmap`` pages per call.

    By default glibc serves large allocations with ``mmap`` and trims freed heap memory back to
    the system, so each forward pass page-faults its activations in again. That costs the most
    where tensors are largest, i.e. in a fused model running M members' rows at once (timings:
    ``docs/benchmarks.md``). The price is bounded: at most ``trim_threshold`` bytes of freed
    memory stay reserved by the process, and allocations above ``mmap_threshold`` still go to
    ``mmap``. Returns True when applied (Linux with glibc), False otherwise.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: the options mean this there
            return False
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


ALLOCATOR_ENV = "HYDRA_TUNE_ALLOCATOR"


@functools.cache
def ensure_cpu_allocator_tuned() -> bool:
    """`tune_cpu_allocator` once per process, unless ``HYDRA_TUNE_ALLOCATOR=0``; logs what it did.
    Fused models call it on their first CPU forward, so Python API users get it without asking."""
    if os.environ.get(ALLOCATOR_ENV, "1") == "0":
        return False
    applied = tune_cpu_allocator()
    if applied:
        logging.getLogger("hydra_ensembles").info(
            "hydra_ensembles: glibc keeps up to 512 MiB of freed memory for reuse (faster CPU "
            "inference; %s=0 turns this off)",
            ALLOCATOR_ENV,
        )
    return applied


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (``/proc/cpuinfo``; empty flags where unreadable)."""
    import platform

    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


@functools.cache
def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache (sysfs on Linux), or None where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


CHUNK_CACHE_SHARE = 0.75
"""Share of the last-level cache one inference chunk's widest activation may fill: the fastest of
the chunk sizes ``benchmarks/chunk_rows.py`` compares (timings: ``docs/benchmarks.md``)."""

DEFAULT_CACHE_BYTES = 32 << 20


def inference_chunk_rows(width: int, itemsize: int, device) -> int | None:
    """Token rows per chunk for inference of a model whose widest activation has ``width``
    elements of ``itemsize`` bytes per row, or None to run the whole batch at once.

    On a CPU, activations that outgrow the last-level cache make every op stream from memory:
    a member-stacked batch (M times one model's rows) is run in chunks whose widest activation
    fits in a share of the cache. ``HYDRA_CHUNK_ROWS`` overrides (0 disables). GPUs want the
    whole batch: None.
    """
    override = os.environ.get("HYDRA_CHUNK_ROWS")
    if override is not None:
        rows = int(override)
        return rows if rows > 0 else None
    if getattr(device, "type", device) != "cpu":
        return None
    cache = last_level_cache_bytes() or DEFAULT_CACHE_BYTES
    return max(256, int(CHUNK_CACHE_SHARE * cache / (width * itemsize)))


def describe_machine() -> str:
    """CPU model, cores, bf16/AMX support, torch version and threads, in one line."""
    import torch

    model, flags = cpu_info()
    features = [
        "AMX" if {"amx_bf16", "amx_tile"} & flags else "no AMX",
        "AVX-512 BF16" if "avx512_bf16" in flags else "no AVX-512 BF16",
    ]
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"{model}, {os.cpu_count()} cores ({', '.join(features)}){gpu}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
