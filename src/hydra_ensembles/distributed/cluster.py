"""Where the work runs: Ray embedded on this machine (the default) or an existing Ray cluster,
and how many scoring workers it holds.

Each worker is an actor that holds one CPU and loads the model once; every node keeps at least
half a CPU free for the tasks that read the data and write the records (an actor pool that takes
every CPU leaves the reads none, and the job waits forever). On this machine the workers share
its cores, and each computes with its share of them as threads, never with every core."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

READ_CPUS = 0.25
"""The CPUs a read or write task declares: it fits in the half CPU each node keeps free."""


def require_ray() -> Any:
    """The ``ray`` module (with Ray Data); InputError naming the extra where it is not installed."""
    try:
        import ray
        import ray.data
    except ImportError:
        raise InputError(
            'this needs Ray, which the core install leaves out: pip install "hydra-ensembles[ray]"'
        ) from None
    return ray


@dataclass(frozen=True)
class RayPlan:
    """The scoring workers of one job: how many (``workers``, one CPU each) and how many threads
    each computes with (``threads``); ``embedded``: Ray was started on this machine for the job."""

    workers: int
    threads: int
    embedded: bool

    def describe(self) -> str:
        where = "Ray embedded on this machine" if self.embedded else "the Ray cluster"
        return f"{self.workers} worker(s) of {self.threads} thread(s) on {where}"


def worker_room(nodes: list[dict[str, Any]]) -> int:
    """How many one-CPU workers the alive ``nodes`` (``ray.nodes()``) hold while each keeps half
    a CPU for reading and writing."""
    return sum(
        max(0, math.floor(node.get("Resources", {}).get("CPU", 0) - 0.5))
        for node in nodes
        if node.get("Alive")
    )


@contextlib.contextmanager
def ray_session(address: str | None = None, workers: int | None = None) -> Iterator[RayPlan]:
    """Ray, for the length of the block: connected to ``address`` (``auto``, ``ray://host:port``)
    or, without one, embedded on this machine (a new instance, whatever an earlier killed run left
    behind) and shut down after; an instance this process already runs is used as it is. Yields
    the plan of ``workers`` scoring workers (default: as many as fit); InputError where they do
    not fit."""
    ray = require_ray()
    cores = os.cpu_count() or 1
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise InputError(f"--workers must be a positive whole number, got {workers!r}")
    started = not ray.is_initialized()
    embedded = address is None
    if started:
        options = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if embedded:  # "local": a new instance, never the one a killed run's cluster file names
            wanted = workers or max(1, cores - 1)
            ray.init(address="local", num_cpus=max(cores, wanted + 1), **options)
        else:
            try:
                ray.init(address=address, **options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise InputError(f"cannot connect to the Ray cluster at {address}: {exc}") from None
    try:
        room = worker_room(ray.nodes())
        count = workers or room
        if count < 1 or count > room:
            raise InputError(
                f"the Ray cluster holds {room} worker(s) of one CPU each (each node keeps half a CPU "
                f"for reading and writing): ask for at most {room} with --workers"
                if room
                else "the Ray cluster has no node with more than half a CPU free for a worker"
            )
        threads = max(1, cores // count) if embedded else 1
        yield RayPlan(count, threads, embedded)
    finally:
        if started:
            ray.shutdown()
