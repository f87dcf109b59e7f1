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


def _when_scoring(workers: int, act, done: list) -> None:
    """Once ``workers`` scoring actors run here and have scored a while, ``act()``, until it returns
    what it did (appended to ``done``; None: nothing, try again); give up after two minutes."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done:
        if len(_scoring_workers()) >= workers:
            time.sleep(1.0)  # mid-job: they have loaded the model and scored some batches
            did = act()
            if did is not None:
                done.append(did)
        time.sleep(0.1)


def _kill_a_worker() -> int | None:
    """SIGKILL the process of a scoring actor: its process id (None where none runs now)."""
    for pid in _scoring_workers():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # gone since it was listed
            continue
        return pid
    return None


def _corpus(tmp_path: Path, parts: int) -> Path:
    """3,000 short texts, two in three ID-like, in ``parts`` CSV files."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = [f"goal match team score {i}" if i % 3 else f"recipe with flour {i}" for i in range(3000)]
    for part in range(parts):
        (corpus / f"part{part}.csv").write_text("text\n" + "\n".join(texts[part::parts]) + "\n")
    return corpus


def test_two_nodes_and_a_killed_worker_yield_every_row_once(tuned, cluster, tmp_path):
    from tests.distributed.test_ray_scoring import read_predictions

    corpus = _corpus(tmp_path, 4)
    killed: list = []
    killer = threading.Thread(target=_when_scoring, args=(1, _kill_a_worker, killed), daemon=True)
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


def test_a_node_removed_mid_job_costs_no_row(tuned, cluster, tmp_path, capsys):
    """A third node joins, and is removed from the cluster while its worker scores: its batches
    are scored again elsewhere, and the output holds every input row exactly once."""
    from tests.distributed.test_ray_scoring import read_predictions

    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    corpus = _corpus(tmp_path, 6)
    removed: list = []

    def remove() -> object:  # its raylet and workers killed, without warning
        cluster.remove_node(node, allow_graceful=False)
        return node

    # one worker on each node, the added one's among them
    remover = threading.Thread(target=_when_scoring, args=(3, remove, removed), daemon=True)
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
