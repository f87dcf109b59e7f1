"""``predict --engine ray``: the records of single-process ``predict`` for every row, scored by
Ray Data workers (embedded on this machine, and on a two-node cluster), the false-discovery-rate
screening decided over the whole dataset exactly as one process decides it, a bad row refused as
``predict`` refuses it, a killed worker costing no row, an interrupted job leaving no output."""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from hydra_cli import main
from hydra_ensembles.evaluation.conformal import benjamini_hochberg, benjamini_hochberg_cutoff

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # one worker: one Ray instance and one tiny model

from hydra_ensembles.distributed import (  # noqa: E402  (after the skip: Ray is an extra)
    PREDICTIONS_MANIFEST,
    read_predictions,
    worker_room,
)
from tests.distributed.conftest import COMMON  # noqa: E402

SCORE_FIELDS = ("ood_score_",)
"""Float64 feature scores: a matrix product over a batch of 8 rows rounds in another order than
over the whole file (1e-13 relative seen); every other field is identical."""


def _single_process(w, out, *options) -> list[dict]:
    rows = []
    for part in ("a", "b"):
        path = out / f"{part}.jsonl"
        args = ["predict", str(w / "tuned"), "--data", str(w / "corpus" / f"{part}.csv"), "--out", str(path)]
        assert main([*args, *COMMON, *options]) == 0
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def _assert_same_records(got: list[dict], expected: list[dict]) -> None:
    assert [r["id"] for r in got] == [r["id"] for r in expected]  # every row exactly once, in order
    for a, b in zip(got, expected, strict=True):
        assert set(a) == set(b)
        for key in a:
            if key.startswith(SCORE_FIELDS):
                assert a[key] == pytest.approx(b[key], rel=1e-10), (a["id"], key)
            else:
                assert a[key] == b[key], (a["id"], key)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.ray
@pytest.mark.slow  # a Ray job of two workers (30 s on one pytest worker): CI's slow run
def test_ray_writes_predicts_records_and_screens_the_whole_dataset(
    tuned, embedded, tmp_path, capsys, precision
):
    """Two files scored by two workers with --fdr: predict's records (ids, classes,
    probabilities, OOD scores, p-values, sets) row for row, every row exactly once, in a folder
    published whole with its manifest; the flags are the Benjamini-Hochberg selection of one
    process over all rows of both files, exactly (not per file, not per block)."""
    out = tmp_path / "preds"
    gone = subprocess.Popen(["true"])  # a killed run's staging folder: its process is gone
    gone.wait()
    staged = tmp_path / f".preds.{gone.pid}.x.tmp"
    (staged / "records").mkdir(parents=True)
    (staged / "records" / "half.parquet").write_bytes(b"PAR1")
    args = ["predict", str(tuned / "tuned"), "--data", str(tuned / "corpus" / "*.csv"), "--engine", "ray"]
    options = [*COMMON, "--precision", precision]  # each worker computes in it, as one process does
    assert main([*args, "--workers", "2", "--fdr", "0.1", "--out", str(out), *options]) == 0
    assert not staged.exists()
    assert "staged records beside" in capsys.readouterr().out
    expected = _single_process(tuned, tmp_path, "--precision", precision)  # per-input flags; then:
    selected = benjamini_hochberg([r["ood_p_value"] for r in expected], 0.1)
    assert 0 < selected.sum() < len(expected)
    for row, chosen in zip(expected, selected, strict=True):
        row["flagged"] = bool(chosen)
    got = read_predictions(out)
    _assert_same_records(got, expected)
    manifest = json.loads((out / PREDICTIONS_MANIFEST).read_text())
    assert manifest["rows"] == len(expected) == 90 and manifest["flagged"] == selected.sum()
    assert {"ood_p_value", "prediction_set", "p_sport"} <= set(got[0])
    assert manifest["settings"]["fdr"] == 0.1


@pytest.mark.ray
@pytest.mark.slow  # a Ray job that fails: CI's slow run
def test_ray_refuses_a_bad_row_in_one_line_and_writes_nothing(tuned, embedded, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.csv").write_text("text\nfine text\n\nanother\n   \n")
    (bad / "y.csv").write_text("text\nmore text\n")
    out = tmp_path / "out"
    args = ["predict", str(tuned / "tuned"), "--data", str(bad / "*.csv"), "--engine", "ray"]
    assert main([*args, "--out", str(out), *COMMON]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hydra-ens: ") and "empty 'text'" in err[-1] and "x.csv" in err[-1], err[-1]
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_the_cutoff_from_counts_selects_what_sorting_selects():
    """benjamini_hochberg_cutoff from one count per distinct p-value, in any order, selects what
    the procedure on the sorted p-values selects (conformal p-values on a grid, with ties)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        n, m = int(rng.integers(1, 60)), int(rng.integers(1, 300))
        p = rng.integers(1, n + 2, size=m) / (n + 1)
        level = float(rng.uniform(0.01, 0.5))
        order = np.argsort(p, kind="stable")
        passing = np.flatnonzero(p[order] * m <= level * np.arange(1, m + 1))
        expected = np.zeros(m, dtype=bool)
        if passing.size:
            expected[order[: passing[-1] + 1]] = True
        values, counts = np.unique(p, return_counts=True)
        shuffle = rng.permutation(len(values))
        cutoff = benjamini_hochberg_cutoff(values[shuffle], counts[shuffle], level)
        assert ((p <= cutoff) == expected).all(), trial
        assert (benjamini_hochberg(p, level) == expected).all(), trial
    assert benjamini_hochberg_cutoff([], [], 0.1) == -math.inf
    with pytest.raises(ValueError, match="positive count"):
        benjamini_hochberg_cutoff([0.5], [0], 0.1)


def test_workers_fit_where_each_node_keeps_half_a_cpu_for_reading():
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 1.0}}]
    assert worker_room(nodes) == 1  # two CPUs: one worker and a CPU to read with; one CPU: none
    assert worker_room([*nodes, {"Alive": False, "Resources": {"CPU": 8.0}}]) == 1
    assert worker_room([{"Alive": True, "Resources": {"CPU": 16.0}}]) == 15


def test_ray_options_are_checked_before_any_work(tuned, tmp_path, capsys):
    model, data = str(tuned / "tuned"), str(tuned / "corpus" / "*.csv")
    cases = [
        (["--out", str(tmp_path / "p.jsonl")], "is a folder of Parquet files"),
        (["--out", str(tmp_path / "o"), "--labelled"], "--labelled"),
        (["--out", str(tmp_path / "o"), "--allow-random-head"], "its own random head"),
        (["--out", str(tmp_path / "o"), "--data", str(tmp_path / "none*.csv")], "names no file"),
    ]
    for extra, message in cases:
        args = ["predict", model, "--data", data, "--engine", "ray", *extra]
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_http_answer_is_one_line_for_bad_input_and_an_id_for_a_failure(caplog):
    """POST /predict's answer without a server: a body that is not JSON, a bad field, and a
    failure inside the model (500 naming an id the log explains, no traceback to the client)."""
    import asyncio

    pytest.importorskip("fastapi")
    from hydra_ensembles.distributed.serve import _answer

    class Request:
        def __init__(self, body):
            self.body = body

        async def json(self):
            if isinstance(self.body, Exception):
                raise self.body
            return self.body

    async def echo(text):
        return {"text": text}

    async def broken(text):
        raise RuntimeError("the model failed")

    answer = asyncio.run(_answer(echo, Request({"inputs": ["a", "b"]})))
    assert answer.status_code == 200 and json.loads(answer.body) == {
        "records": [{"text": "a"}, {"text": "b"}]
    }
    answer = asyncio.run(_answer(echo, Request(json.JSONDecodeError("Expecting value", "{x", 1))))
    assert answer.status_code == 400 and "not JSON" in json.loads(answer.body)["error"]
    answer = asyncio.run(_answer(echo, Request({"inputs": "   "})))
    assert answer.status_code == 422 and json.loads(answer.body)["error"] == "inputs is empty"
    answer = asyncio.run(_answer(broken, Request({"inputs": ["a"]})))
    error = json.loads(answer.body)["error"]
    assert (
        answer.status_code == 500 and error.startswith("internal error ") and "the model failed" not in error
    )
    failure = error.split()[2].rstrip(":")
    assert any(failure in record.getMessage() and record.exc_info for record in caplog.records)


def test_calibrate_on_ray_refuses_what_it_cannot_fit_before_any_work(tuned, tmp_path, capsys):
    """No training data; a flag score fit only in one process (registered here: no passes)."""
    from hydra_ensembles.ood import registry

    @registry.register_feature_score
    class OneProcess(registry.FeatureScore):
        name = "one_process_only"

    base = ["calibrate", str(tuned / "tuned"), "--val-data", str(tuned / "train.csv"), "--engine", "ray"]
    cases = [
        ([], "give the labelled training data"),
        (
            ["--data", str(tuned / "train.csv"), "--flag-score", "one_process_only"],
            "is fit in one process only",
        ),
    ]
    try:
        for extra, message in cases:
            assert main([*base, *extra, "--out", str(tmp_path / "o"), *COMMON]) == 2
            assert message in capsys.readouterr().err
    finally:
        registry._REGISTRY.pop("one_process_only")
    assert not (tmp_path / "o").exists()


def test_a_predictions_manifest_naming_files_elsewhere_is_refused(tmp_path):
    """read_predictions reads only the manifest's files of records/: a name that climbs out of the
    folder, a missing file and a link are refused before anything is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    outside = tmp_path / "someone"
    outside.mkdir()
    pq.write_table(pa.table({"id": ["x/0"], "secret": [1]}), outside / "theirs.parquet")
    folder = tmp_path / "preds"
    (folder / "records").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["a.csv/0"], "flagged": [True]}), folder / "records" / "ok.parquet")
    cases = [
        ({"../someone/theirs.parquet": 1}, "not a file of records/"),
        ({"records/../../someone/theirs.parquet": 1}, "not a file of records/"),
        ({"records/gone.parquet": 1}, "is missing"),
    ]
    for files, message in cases:
        (folder / PREDICTIONS_MANIFEST).write_text(json.dumps({"files": files, "rows": 1}))
        with pytest.raises(ValueError, match=message):
            read_predictions(folder)
    (folder / "records" / "link.parquet").symlink_to(outside / "theirs.parquet")
    (folder / PREDICTIONS_MANIFEST).write_text(json.dumps({"files": {"records/link.parquet": 1}, "rows": 1}))
    with pytest.raises(ValueError, match="link"):
        read_predictions(folder)
    (folder / "records" / "link.parquet").unlink()
    (folder / PREDICTIONS_MANIFEST).write_text(json.dumps({"files": {"records/ok.parquet": 1}, "rows": 1}))
    assert read_predictions(folder) == [{"id": "a.csv/0", "flagged": True}]


@pytest.mark.ray
@pytest.mark.slow  # two Ray jobs: CI's slow run
def test_ray_scores_an_image_folder_as_predict_does(embedded, tmp_path, capsys):
    """An image folder (class sub-folders of PNG files, read in parts by Ray's read tasks, one part
    of one class only): calibrate --engine ray fits the statistics calibrate fits in one process
    (a model naming no classes: the folder's classes numbered as a whole); scored by the
    calibrated ViT on Ray: predict's records for every image, ids and order included; an
    unreadable image ends the job with predict's one line naming it, nothing written."""
    import torch

    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.distributed import scoring
    from hydra_ensembles.loading import load_any
    from tests.factories import tiny_vit_and_photos

    photos = tiny_vit_and_photos(tmp_path, 40, named=False)
    cal = ["calibrate", str(tmp_path / "vit"), "--val-data", photos, "--data", photos, "--flag-score", "mds"]
    cal += ["--precision", "fp32"]
    assert main([*cal, "--out", str(tmp_path / "calibrated")]) == 0
    assert main([*cal, "--engine", "ray", "--out", str(tmp_path / "on-ray")]) == 0
    local, on_ray = (saved_calibration(load_any(str(tmp_path / n))) for n in ("calibrated", "on-ray"))
    for key, value in local.flag.statistics.tensors.items():
        if not key.startswith("vim."):  # ViM within its Davis-Kahan bound: test_ray_statistics.py
            mine = on_ray.flag.statistics.tensors[key]
            torch.testing.assert_close(
                mine, value, rtol=1e-10, atol=1e-10 * value.abs().max().item(), msg=key
            )
    args = [
        "predict",
        str(tmp_path / "calibrated"),
        "--data",
        photos,
        "--precision",
        "fp32",
        "--batch-size",
        "8",
    ]
    assert main([*args, "--engine", "ray", "--workers", "2", "--out", str(tmp_path / "preds")]) == 0
    assert main([*args, "--out", str(tmp_path / "one.jsonl")]) == 0
    expected = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    got = read_predictions(tmp_path / "preds")
    assert len(got) == 80 and got[0]["id"] == "cat/0.png" and "ood_score_mds" in got[0]
    assert scoring.IMAGES_PER_READ % 40 and scoring.IMAGES_PER_READ < 80  # a part of one class
    _assert_same_records(got, expected)
    (tmp_path / "photos" / "dog" / "broken.png").write_bytes(b"not a png")
    capsys.readouterr()
    assert main([*args, "--engine", "ray", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "broken.png is not a readable image" in err and not (tmp_path / "bad").exists()
    import shutil

    shutil.copytree(tmp_path / "photos", tmp_path / "val", ignore=shutil.ignore_patterns("broken.png"))
    cal[cal.index("--val-data") + 1] = str(tmp_path / "val")  # the broken image only in --data:
    assert main([*cal, "--engine", "ray", "--out", str(tmp_path / "bad")]) == 2  # read by Ray's tasks
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hydra-ens: ") and "broken.png is not a readable image" in err, err
    assert not (tmp_path / "bad").exists()
