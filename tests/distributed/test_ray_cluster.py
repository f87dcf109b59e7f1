"""``predict --engine ray --address`` on a Ray cluster of two nodes started on this machine
(`ray.cluster_utils.Cluster`), with a scoring worker's process killed mid-job, and with a third
node removed from the cluster mid-job: Ray restarts the worker (or its actor elsewhere) and
retries its batches, and the output holds every input row exactly once, with predict's records."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hydra_cli import main
from tests.distributed.test_ray_scoring import COMMON, _assert_same_records

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def _scoring_workers() -> list[int]:
    """The processes of this machine's scoring actors (Ray titles them after their class)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):
            continue
        if entry.isdigit() and title.startswith("ray::MapWorker(MapBatches(_Scorer))"):
            pids.append(int(entry))
    return pids


def _kill_a_worker_when_scoring(killed: list) -> None:
    """SIGKILL the process of the first scoring actor seen (once it has scored a while)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not killed:
        alive = _scoring_workers()
        if alive:
            time.sleep(1.0)  # mid-job: it has loaded the model and scored some batches
            os.kill(alive[0], signal.SIGKILL)
            killed.append(alive[0])
        time.sleep(0.1)


def test_two_nodes_and_a_killed_worker_yield_every_row_once(tuned, cluster, tmp_path):
    from tests.distributed.test_ray_scoring import read_predictions

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"goal match team score {i}" if i % 3 else f"recipe with flour {i}" for i in range(3000)]
    for part in range(4):
        rows = texts[part::4]
        (corpus / f"part{part}.csv").write_text("text\n" + "\n".join(rows) + "\n")
    killed: list = []
    killer = threading.Thread(target=_kill_a_worker_when_scoring, args=(killed,), daemon=True)
    killer.start()
    out = tmp_path / "preds"
    args = ["predict", str(tuned / "tuned"), "--data", str(corpus / "*.csv"), "--engine", "ray"]
    assert main([*args, "--address", cluster.address, "--out", str(out), *COMMON]) == 0
    killer.join(timeout=5)
    assert killed, "no scoring worker was seen to kill"
    assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} and len(ray.nodes()) == 2
    got = read_predictions(out)
    expected = []
    for part in range(4):
        path = tmp_path / f"part{part}.jsonl"
        data = ["--data", str(corpus / f"part{part}.csv"), "--out", str(path)]
        assert main(["predict", str(tuned / "tuned"), *data, *COMMON]) == 0
        expected += [json.loads(line) for line in path.read_text().splitlines()]
    assert len(got) == len({r["id"] for r in got}) == 3000
    _assert_same_records(got, expected)


def _remove_when_scoring(cluster, node, removed: list) -> None:
    """Remove ``node`` from ``cluster`` (its raylet and workers killed) once scoring runs."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not removed:
        if len(_scoring_workers()) >= 3:  # one on each node, the added one's among them
            time.sleep(1.0)  # mid-job: they have loaded the model and scored some batches
            cluster.remove_node(node, allow_graceful=False)
            removed.append(node)
        time.sleep(0.1)


def test_a_node_removed_mid_job_costs_no_row(tuned, cluster, tmp_path, capsys):
    """A third node joins, and is removed from the cluster while its worker scores: its batches
    are scored again elsewhere, and the output holds every input row exactly once."""
    from tests.distributed.test_ray_scoring import read_predictions

    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"goal match team score {i}" if i % 3 else f"recipe with flour {i}" for i in range(3000)]
    for part in range(6):
        (corpus / f"part{part}.csv").write_text("text\n" + "\n".join(texts[part::6]) + "\n")
    removed: list = []
    remover = threading.Thread(target=_remove_when_scoring, args=(cluster, node, removed), daemon=True)
    remover.start()
    out = tmp_path / "preds"
    args = ["predict", str(tuned / "tuned"), "--data", str(corpus / "*.csv"), "--engine", "ray"]
    assert main([*args, "--address", cluster.address, "--out", str(out), *COMMON]) == 0
    remover.join(timeout=5)
    assert removed, "no node was removed while scoring"
    assert "3 worker(s)" in capsys.readouterr().out  # one on each node: the removed one's among them
    assert sum(n["Alive"] for n in ray.nodes()) == 2
    got = read_predictions(out)
    assert len(got) == len({r["id"] for r in got}) == 3000
    assert sorted(r["id"] for r in got) == sorted(f"part{p}.csv/{i}" for p in range(6) for i in range(500))
