"""``hydra-ens serve``'s application on Ray Serve, asked over HTTP by a real client: predict's
records, concurrent requests batched, bad requests answered 4xx in one line while the server
serves on, the OpenAPI schema, and a replica killed under load restarted with no request
answered wrongly."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hydra_cli import main
from tests.distributed.conftest import COMMON

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]

TEXTS = [f"goal match team score {i}" if i % 3 else f"recipe with flour {i}" for i in range(24)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tuned):
    from hydra_ensembles.distributed.serve import serve_application

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = serve_application(str(tuned / "tuned"), replicas=1, max_batch_size=8, batch_wait_ms=20)
    serve.run(app, name="hydra", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _post(url: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}/predict", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:  # the proxy answers 503 in plain text while a replica restarts
        text = error.read()
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, {"error": text.decode(errors="replace")}


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=60) as answer:
        return json.loads(answer.read())


def _expected(tuned, tmp_path) -> list[dict]:
    path = tmp_path / "texts.csv"
    path.write_text("text\n" + "\n".join(TEXTS) + "\n")
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(tuned / "tuned"), "--data", str(path), "--out", str(out), *COMMON]) == 0
    return [{k: v for k, v in json.loads(line).items() if k != "id"} for line in out.read_text().splitlines()]


STEP = 1 / 25
"""One step of the conformal p-values' grid, 1/(n+1) for the n = 24 validation inputs of the
saved calibration (checked in the first test): a score that moves by rounding past one of the
calibration's scores moves its p-value by one step."""


def _assert_close(got: dict, expected: dict) -> None:
    """Equal records, up to the rounding of another batch's padding (fp32: the probabilities to
    1e-5, the OOD score to 1e-4 relative, the p-value by at most one step of its grid); the class,
    flag and set are compared where the probabilities and p-value came out equal."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key == "ood_p_value":
            assert abs(got[key] - value) <= STEP + 1e-12, key
        elif isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        elif key not in ("flagged", "prediction_set", "set_size", "predicted"):
            assert got[key] == value, key
    if got.get("ood_p_value") == expected.get("ood_p_value"):
        assert got["flagged"] == expected["flagged"]


def test_served_records_are_predicts_and_bad_requests_get_one_line(server, tuned, tmp_path):
    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.loading import load_any

    assert 1 / (len(saved_calibration(load_any(str(tuned / "tuned"))).flag.calibration_scores) + 1) == STEP
    expected = _expected(tuned, tmp_path)
    status, answer = _post(server, {"inputs": TEXTS})
    assert status == 200 and len(answer["records"]) == len(TEXTS)
    for got, want in zip(answer["records"], expected, strict=True):
        _assert_close(got, want)
    status, one = _post(server, {"inputs": TEXTS[0]})
    assert status == 200 and len(one["records"]) == 1
    _assert_close(one["records"][0], expected[0])
    with ThreadPoolExecutor(8) as pool:  # concurrent requests, batched together
        answers = list(pool.map(lambda t: _post(server, {"inputs": [t]}), TEXTS))
    for (status, body), want in zip(answers, expected, strict=True):
        assert status == 200
        _assert_close(body["records"][0], want)
    bad = [
        (b"{not json", 400, "not JSON"),
        ({"texts": ["a"]}, 422, '"inputs"'),
        ({"inputs": ["fine", "  "]}, 422, "inputs[1] is empty"),
        ({"inputs": [1]}, 422, "inputs[0] is a int"),
        ({"inputs": ["x"] * 257}, 422, "at most 256"),
        ({"inputs": "y" * 20_001}, 422, "at most 20000"),
    ]
    for body, code, message in bad:
        status, answer = _post(server, body)
        assert status == code and message in answer["error"] and "\n" not in answer["error"], answer
    assert _post(server, {"inputs": TEXTS[:2]})[0] == 200  # serving on
    assert _get(server, "/healthz") == {"status": "ok"}
    info = _get(server, "/info")
    assert info["classes"] == ["money", "sport"] and "mds" in info["calibration"]
    schema = _get(server, "/openapi.json")
    assert "/predict" in schema["paths"] and "requestBody" in schema["paths"]["/predict"]["post"]


def _replica_pids() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            title = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if entry.isdigit() and title.startswith("ray::ServeReplica:hydra:HydraServer"):
            pids.append(int(entry))
    return pids


def _the_replica() -> int:
    """The process id of the application's one replica, once the replicas of an earlier Ray
    instance on this machine (whose worker processes can outlive its shutdown for a moment) are
    gone; a second live one fails the test."""
    deadline = time.monotonic() + 60
    while len(pids := _replica_pids()) > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(pids) == 1, f"replica processes {pids}: expected the application's one"
    return pids[0]


def test_a_replica_killed_under_load_is_restarted_and_answers_nothing_wrong(server, tuned, tmp_path):
    expected = _expected(tuned, tmp_path)
    pid = _the_replica()
    results: list = []

    def load() -> None:
        deadline = time.monotonic() + 90
        i = 0
        while time.monotonic() < deadline and not (
            len(results) > 40 and [p for p in _replica_pids() if p != pid]
        ):
            try:
                results.append(
                    (i % len(TEXTS), *_post(server, {"inputs": [TEXTS[i % len(TEXTS)]]}, timeout=30))
                )
            except OSError as exc:  # the connection dropped with the replica
                results.append((i % len(TEXTS), None, str(exc)))
            except Exception as exc:  # anything else ends the load: the test fails on it
                failures.append(exc)
                return
            i += 1

    failures: list[Exception] = []
    worker = threading.Thread(target=load)
    worker.start()
    time.sleep(2)
    os.kill(pid, signal.SIGKILL)
    worker.join()
    assert not failures, failures
    deadline = time.monotonic() + 60
    while not [p for p in _replica_pids() if p != pid] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for p in _replica_pids() if p != pid], (
        f"the replica was not restarted ({len(results)} requests)"
    )
    answered = [(i, body) for i, status, body in results if status == 200]
    assert len(answered) > 10
    for i, body in answered:  # an answer is right or is an error, never a wrong record
        _assert_close(body["records"][0], expected[i])
    assert all(status in (200, 500, 503, None) for _, status, _ in results)
    assert _post(server, {"inputs": TEXTS[:3]})[0] == 200


def test_an_image_model_is_served_with_predicts_records(server, vit, tmp_path):
    """A second application on the same Ray Serve: an image model, asked with base64 PNG files
    (one request of all, and concurrent single ones), answers predict's records (within fp32's
    rounding of another batch); an unreadable image gets a 422 naming its field, serving on."""
    import base64

    from hydra_ensembles.distributed.serve import serve_application

    serve.run(
        serve_application(str(vit / "calibrated"), max_batch_size=8), name="images", route_prefix="/images"
    )
    url = f"{server}/images"
    files = sorted((vit / "photos").glob("*/*.png"))
    encoded = [base64.b64encode(f.read_bytes()).decode() for f in files]
    out = tmp_path / "p.jsonl"
    args = ["predict", str(vit / "calibrated"), "--data", str(vit / "photos"), "--out", str(out)]
    assert main(args) == 0
    expected = [
        {k: v for k, v in json.loads(line).items() if k != "id"} for line in out.read_text().splitlines()
    ]
    status, answer = _post(url, {"inputs": encoded})
    assert status == 200 and len(answer["records"]) == len(files) == len(expected)
    with ThreadPoolExecutor(8) as pool:
        single = list(pool.map(lambda image: _post(url, {"inputs": image}), encoded))
    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.loading import load_any

    calibration = saved_calibration(load_any(str(vit / "calibrated")))
    steps = 1 / (len(calibration.flag.calibration_scores) + 1)  # one step of the p-values' grid
    for records in (answer["records"], [body["records"][0] for _, body in single]):
        for got, want in zip(records, expected, strict=True):
            assert got.keys() == want.keys() and got["predicted"] == want["predicted"]
            assert abs(got["ood_p_value"] - want["ood_p_value"]) <= steps + 1e-12
            assert got["p_cat"] == pytest.approx(want["p_cat"], rel=1e-4, abs=1e-5)
    status, answer = _post(url, {"inputs": [encoded[0], base64.b64encode(b"GIF89a").decode()]})
    assert status == 422 and answer["error"].startswith("inputs[1] is not a readable image"), answer
    assert _post(url, {"inputs": encoded[:2]})[0] == 200  # serving on
    assert _get(server, "/images/info")["inputs"] == "images (base64 files)"
    serve.delete("images")


def test_the_serve_command_starts_answers_and_stops_on_sigterm(vit):
    """``hydra-ens serve`` as a user runs it (its own process and embedded Ray), on an image
    model: healthy once loaded, answers a base64 image, and SIGTERM stops it (exit 0)."""
    import base64
    import subprocess
    import sys

    port = _free_port()
    script = "import sys; from hydra_cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", script, "serve", str(vit / "calibrated"), "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if _get(url, "/healthz") == {"status": "ok"}:
                    break
            except OSError:
                time.sleep(1)
        image = base64.b64encode((vit / "photos" / "cat" / "0.png").read_bytes()).decode()
        status, answer = _post(url, {"inputs": image})
        assert status == 200 and len(answer["records"]) == 1 and "ood_p_value" in answer["records"][0]
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    assert f"serving {vit / 'calibrated'} at {url}" in out and out.rstrip().endswith("stopped")
