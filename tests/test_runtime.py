"""How inference chunks are sized: the last-level cache from sysfs where it is plausible for the
CPUs sharing it, measured where a virtual machine's sysfs reports its host's whole socket."""

from __future__ import annotations

import pytest

import hydra_ensembles.runtime as runtime

MIB = 1 << 20


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.MACHINE_CACHE_ENV, str(tmp_path))
    runtime.chunk_cache_bytes.cache_clear()
    yield
    runtime.chunk_cache_bytes.cache_clear()


def test_cpu_lists_are_counted():
    assert runtime._cpus_in("0-1") == 2
    assert runtime._cpus_in("0-3,8,10-11\n") == 7
    assert runtime._cpus_in("5") == 1


def test_a_plausible_sysfs_cache_is_used_as_it_is(monkeypatch, fresh):
    monkeypatch.setattr(runtime, "_sysfs_last_level_cache", lambda: (32 * MIB, 8))
    monkeypatch.setattr(runtime, "measure_cache_bytes", lambda: pytest.fail("measured"))
    assert runtime.chunk_cache_bytes() == 32 * MIB


def test_a_hosts_cache_seen_from_a_guest_is_measured_once_and_bounded(monkeypatch, fresh):
    """480 MiB shared by 2 CPUs (240 MiB each) is the host's socket: the cache is measured, kept
    per machine, and held within [MIN_CACHE_BYTES, sysfs's]."""
    monkeypatch.setattr(runtime, "_sysfs_last_level_cache", lambda: (480 * MIB, 2))
    calls = []
    monkeypatch.setattr(runtime, "measure_cache_bytes", lambda: calls.append(1) or 32 * MIB)
    assert runtime.chunk_cache_bytes() == 32 * MIB
    runtime.chunk_cache_bytes.cache_clear()  # a new process reads the kept measurement
    assert runtime.chunk_cache_bytes() == 32 * MIB and calls == [1]
    assert runtime.machine_cache_path().is_file()
    runtime.machine_cache_path().unlink()
    runtime.chunk_cache_bytes.cache_clear()
    monkeypatch.setattr(runtime, "measure_cache_bytes", lambda: 1 * MIB)  # an implausibly small edge
    assert runtime.chunk_cache_bytes() == runtime.MIN_CACHE_BYTES
    runtime.machine_cache_path().unlink()
    runtime.chunk_cache_bytes.cache_clear()
    monkeypatch.setattr(runtime, "measure_cache_bytes", lambda: None)  # no edge seen: not kept
    assert runtime.chunk_cache_bytes() == runtime.DEFAULT_CACHE_BYTES
    assert not runtime.machine_cache_path().exists()


def test_no_sysfs_gives_the_default(monkeypatch, fresh):
    monkeypatch.setattr(runtime, "_sysfs_last_level_cache", lambda: None)
    assert runtime.chunk_cache_bytes() == runtime.DEFAULT_CACHE_BYTES


def test_the_cache_edge_is_where_time_per_byte_leaves_the_cache():
    # L2 to 2 MiB, L3 to 32 MiB, memory beyond: the edge is the last size before memory's speed
    times = {1 * MIB: 1.0, 2 * MIB: 1.0, 4 * MIB: 1.6, 8 * MIB: 1.7, 16 * MIB: 1.8, 32 * MIB: 2.0}
    times |= {64 * MIB: 6.0, 128 * MIB: 7.5, 256 * MIB: 8.0}
    assert runtime.cache_edge(times) == 32 * MIB
    assert runtime.cache_edge({MIB: 1.0, 2 * MIB: 1.1, 4 * MIB: 1.2}) is None  # no edge to see


def test_chunk_rows_follow_the_cache(monkeypatch):
    monkeypatch.setattr(runtime, "chunk_cache_bytes", lambda: 32 * MIB)
    monkeypatch.delenv("HYDRA_CHUNK_ROWS", raising=False)
    rows = runtime.inference_chunk_rows(1536, 2, "cpu")
    assert rows == int(runtime.CHUNK_CACHE_SHARE * 32 * MIB / (1536 * 2))
    assert runtime.inference_chunk_rows(1536, 2, "cuda") is None
    monkeypatch.setenv("HYDRA_CHUNK_ROWS", "0")
    assert runtime.inference_chunk_rows(1536, 2, "cpu") is None


def test_the_real_measurement_gives_a_size_it_measured_or_none():
    edge = runtime.measure_cache_bytes(largest=16 * MIB, rounds=2, trials=1)
    assert edge is None or edge in {MIB << i for i in range(5)}


@pytest.mark.parametrize(
    ("total", "largest", "piece"), [(8, 5, 4), (8, 8, 8), (9, 4, 3), (7, 1, 1), (3, 0, 1), (1, 10, 1)]
)
def test_balanced_pieces_are_as_few_and_as_equal_as_the_largest_allows(total, largest, piece):
    assert runtime.balanced_piece(total, largest) == piece


def test_a_measurement_file_that_is_no_regular_file_never_blocks(fresh, tmp_path):
    """A FIFO (or any non-regular file) where ``machine.json`` goes is neither read (that would
    block every command) nor written over: the value is measured and not kept."""
    import os
    import threading

    os.mkfifo(tmp_path / "machine.json")
    result = []
    worker = threading.Thread(target=lambda: result.append(runtime.machine_measurement("x", lambda: 3.0)))
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # unblock the reader so the test process can end, then fail
        with open(tmp_path / "machine.json", "w"):
            pass
        worker.join()
        pytest.fail("reading a FIFO machine.json blocked")
    assert result == [3.0] and (tmp_path / "machine.json").is_fifo()
