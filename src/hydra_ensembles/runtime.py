"""What this machine is and how to run fast on it: CPU flags, cache size, inference chunking."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
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


def _cpus_in(cpu_list: str) -> int:
    """How many CPUs a sysfs list names (``"0-3,8"``: 5)."""
    count = 0
    for part in cpu_list.strip().split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            count += int(high) - int(low) + 1 if high.isdigit() else 1
    return count


@functools.cache
def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache (sysfs on Linux), or None where it cannot be read."""
    largest = _sysfs_last_level_cache()
    return largest[0] if largest else None


def _sysfs_last_level_cache() -> tuple[int, int] | None:
    """(bytes, CPUs sharing it) of the largest cache sysfs describes for CPU 0."""
    found = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip().upper()
            shared = _cpus_in((entry / "shared_cpu_list").read_text())
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            found.append((int(digits) * scale, max(shared, 1)))
    return max(found) if found else None


PLAUSIBLE_CACHE_PER_CPU = 16 << 20
"""More last-level cache per CPU sharing it than any x86 part has (3D V-Cache parts: 12 MiB): a
virtual machine whose sysfs reports more describes its host's whole socket, not what its own CPUs
get, and its cache is measured instead (`measure_cache_bytes`)."""

MIN_CACHE_BYTES = 8 << 20
DEFAULT_CACHE_BYTES = 32 << 20


def measure_cache_bytes(largest: int = 256 << 20, rounds: int = 3, trials: int = 3) -> int | None:
    """The largest working set this machine streams at cache speed, measured: an in-place
    multiply over a preallocated buffer of 1 MiB, 2 MiB, ... ``largest`` (the same number of bytes
    each time, the fastest of ``rounds`` interleaved rounds), its edge found by `cache_edge`; the
    median of ``trials`` such edges (None where most trials see no edge). About a second a trial
    on a 2-core machine."""
    import torch

    sizes = [1 << 20 << i for i in range((largest >> 20).bit_length())]
    buffer = torch.ones(sizes[-1] // 4)
    work = 2 * sizes[-1]
    for size in sizes:
        buffer[: size // 4].mul_(1.0)  # first touch
    edges = []
    for _ in range(trials):
        per_byte = dict.fromkeys(sizes, float("inf"))
        for _ in range(rounds):
            for size in sizes:
                view, repeats = buffer[: size // 4], max(1, work // size)
                start = time.perf_counter()
                for _ in range(repeats):
                    view.mul_(1.0)
                per_byte[size] = min(per_byte[size], (time.perf_counter() - start) / (repeats * size))
        edges.append(cache_edge(per_byte))
    seen = sorted(edge for edge in edges if edge is not None)
    return seen[len(seen) // 2] if 2 * len(seen) > len(edges) else None


def cache_edge(per_byte: dict[int, float]) -> int | None:
    """From seconds per byte by working-set size: the largest size still below the geometric mean
    of the fastest size's time and the largest size's (memory's); None where those two differ by
    less than 1.5x."""
    sizes = sorted(per_byte)
    fastest, memory = min(per_byte.values()), per_byte[sizes[-1]]
    if memory < 1.5 * fastest:
        return None
    edge = math.sqrt(fastest * memory)
    return max(size for size in sizes if per_byte[size] <= edge)


@functools.cache
def chunk_cache_bytes() -> int:
    """The cache inference chunks are sized to: sysfs's last-level cache where it is plausible for
    the CPUs sharing it (`PLAUSIBLE_CACHE_PER_CPU`), else the measured one (`measure_cache_bytes`,
    kept per machine in `machine_cache_path`) within [`MIN_CACHE_BYTES`, sysfs's], else
    `DEFAULT_CACHE_BYTES`."""
    sysfs = _sysfs_last_level_cache()
    if sysfs is None:
        return DEFAULT_CACHE_BYTES
    size, cpus = sysfs
    if size <= PLAUSIBLE_CACHE_PER_CPU * cpus:
        return size
    measured = machine_measurement("last-level cache bytes", measure_cache_bytes)
    if measured is None or measured <= 0:
        return min(size, DEFAULT_CACHE_BYTES)
    return int(min(size, max(MIN_CACHE_BYTES, measured)))


def machine_cache_path() -> Path:
    """Where measurements of this machine are kept: ``$HYDRA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hydra-ensembles``, else ``~/.cache/hydra-ensembles``; ``machine.json``."""
    root = os.environ.get(MACHINE_CACHE_ENV) or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "hydra-ensembles"
    )
    return Path(root) / "machine.json"


MACHINE_CACHE_ENV = "HYDRA_CACHE_DIR"


def machine_measurement(name: str, measure: Callable[[], float | None]) -> float | None:
    """``measure()`` for this machine, read from `machine_cache_path` (keyed by ``name``, the CPU,
    the architecture, torch's version and threads) where it was measured before, else measured
    once and kept there (None results are not kept: measured again next time)."""
    import torch

    model, _ = cpu_info()
    threads = torch.get_num_threads()
    key = f"{name} | {model} | {platform.machine()} | torch {torch.__version__} | {threads} threads"
    path = machine_cache_path()
    from .saving.files import read_json

    try:  # a regular file only (a FIFO there would block every command), of a bounded size
        cached = read_json(path, "machine measurements")  # missing: InputError, a ValueError
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), int | float) and cached[key] > 0:
        return cached[key]
    value = measure()
    if value is not None:
        try:
            from .saving.files import atomic_write_json

            if path.exists() and not path.is_file():
                raise OSError(f"{path} is not a regular file")  # never written over
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {**cached, key: value})
        except (OSError, ValueError):  # a read-only or full home: measured again by the next process
            pass
    return value


CHUNK_CACHE_SHARE = 0.75
"""Share of the cache (`chunk_cache_bytes`) one inference chunk's widest activation may fill: the
fastest of the chunk sizes ``benchmarks/chunk_rows.py`` compares (timings: ``docs/benchmarks.md``)."""


def balanced_piece(total: int, largest: int) -> int:
    """The size of the pieces ``total`` items are cut into when a piece holds at most ``largest``
    (at least 1): as few pieces as that allows, of sizes as equal as possible (8 in two pieces of
    4, not 5 + 3)."""
    pieces = -(-total // max(1, largest))
    return -(-total // pieces)


def inference_chunk_rows(width: int, itemsize: int, device, share: float = CHUNK_CACHE_SHARE) -> int | None:
    """Token rows per chunk for inference of a model whose widest activation has ``width``
    elements of ``itemsize`` bytes per row, or None to run the whole batch at once.

    On a CPU, activations that outgrow the last-level cache make every op stream from memory:
    a member-stacked batch (M times one model's rows) is run in chunks whose widest activation
    fits in a ``share`` of the cache. ``HYDRA_CHUNK_ROWS`` overrides (0 disables). GPUs want the
    whole batch: None.
    """
    override = os.environ.get("HYDRA_CHUNK_ROWS")
    if override is not None:
        rows = int(override)
        return rows if rows > 0 else None
    if getattr(device, "type", device) != "cpu":
        return None
    return max(256, int(share * chunk_cache_bytes() / (width * itemsize)))


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
