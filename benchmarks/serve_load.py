"""Requests per second and latency of ``hydra-ens serve`` (Ray Serve, on this machine) at
concurrency 1, 8 and 32, against calling the uncertainty pipeline in-process with the same
requests, side by side in one run.

    python benchmarks/serve_load.py [--requests 200] [--time-limit 120]

The model: all-MiniLM-L6-v2 with a seeded 4-class head, saved once; one short text (5-12 words)
per request, max length 32. The server binds 127.0.0.1 on a free port; the load comes from this
machine only, a fixed number of requests per setting, and each setting stops at the time limit.
The in-process side calls the pipeline from the same number of threads. Run it on a quiet
machine: the client, the server and the pipeline share its cores.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from distributed_scoring import _model, _texts


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(call, texts: list[str], concurrency: int, limit: float) -> tuple[float, list[float]]:
    """Send every text once with ``concurrency`` threads (stopping at ``limit`` seconds); the
    wall time and each request's latency."""
    latencies: list[float] = []
    deadline = time.monotonic() + limit

    def one(text: str) -> None:
        if time.monotonic() > deadline:
            return
        started = time.perf_counter()
        call(text)
        latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, texts))
    return time.perf_counter() - started, latencies


def main() -> None:
    import ray
    from ray import serve
    from transformers import pipeline

    from hydra_ensembles.distributed.serve import serve_application

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--time-limit", type=float, default=120)
    opts = parser.parse_args()
    texts = _texts(opts.requests, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(_model(Path(tmp) / "model"))
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        port = _port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(serve_application(model, max_length=32, threads=2), name="hydra", route_prefix="/")
        url = f"http://127.0.0.1:{port}/predict"

        def http(text: str) -> None:
            body = json.dumps({"inputs": [text]}).encode()
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()

        served = pipeline("hydra-text-classification", model=model, truncation=True, max_length=32)
        http(texts[0])  # warm both
        served(texts[0])
        print(f"{'way':<22} {'concurrency':>11} {'requests':>8} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}")
        for concurrency in (1, 8, 32):
            for name, call in (("ray serve (HTTP)", http), ("pipeline, in-process", served)):
                seconds, latencies = _load(call, texts, concurrency, opts.time_limit)
                ms = sorted(x * 1e3 for x in latencies)
                p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
                print(
                    f"{name:<22} {concurrency:>11} {len(ms):>8} {len(ms) / seconds:>7.1f} "
                    f"{statistics.median(ms):>7.1f} {p99:>7.1f}"
                )
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
