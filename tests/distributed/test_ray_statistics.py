"""The feature statistics of ``mds``, ``rmds`` and ``mds++`` fit on Ray over training data split
into files of uneven sizes equal the one-process fit on the same rows to 1e-10 relative in
float64 (the members' features are computed in the same batches, so only the order of the sums
differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_ensembles.data import load_spec, model_batches
from hydra_ensembles.evaluation import predict
from hydra_ensembles.loading import load_any, load_preprocessor
from hydra_ensembles.ood import FeatureStatistics
from hydra_ensembles.ood.moments import MERGEABLE_SCORES

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]


def test_the_statistics_fit_on_ray_equal_the_one_process_fit(tuned, embedded, tmp_path):
    from hydra_ensembles.distributed import RayPlan
    from hydra_ensembles.distributed.statistics import fit_statistics_dataset

    rng = np.random.default_rng(0)
    rows = [f"goal match team score {i} {'x' * int(rng.integers(0, 9))},sport" for i in range(24)]
    rows += [f"bank shares market profit {i} {'y' * int(rng.integers(0, 9))},money" for i in range(24)]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    files = []
    for part, (start, stop) in enumerate(((0, 8), (8, 40), (40, 48))):  # uneven, whole batches of 8
        files.append(tmp_path / f"train{part}.csv")
        files[-1].write_text("text,label\n" + "\n".join(rows[start:stop]) + "\n")
    model_path = str(tuned / "tuned")
    model = load_any(model_path)
    got = fit_statistics_dataset(
        model_path, files, RayPlan(2, 1, True), classes=["money", "sport"], num_labels=2, batch_size=8,
        max_length=12, precision="fp32",
    )  # fmt: skip
    features, labels = [], []
    for file in files:
        _, batches = model_batches(load_spec(str(file)), model, load_preprocessor(model_path), 8, 12)
        preds = predict(model, batches, progress=False, precision="fp32")
        features.append(preds.member_features)
        labels += preds.class_labels().tolist()
    expected = FeatureStatistics.fit(
        np.concatenate(features, 1), np.asarray(labels), 2, scores=MERGEABLE_SCORES
    )
    assert got.settings == expected.settings and set(got.tensors) == set(expected.tensors)
    for key, value in expected.tensors.items():
        torch.testing.assert_close(got.tensors[key], value, rtol=1e-10, atol=1e-10 * value.abs().max().item())


def test_calibrate_on_ray_saves_the_calibration_one_process_fits(tuned, embedded, tmp_path):
    """calibrate --engine ray --data: the statistics, threshold and sets of calibrate without it,
    on the same rows (one file: the same batches); the data named by its files' digest."""
    from hydra_cli import main
    from hydra_ensembles.evaluation import saved_calibration
    from tests.distributed.conftest import COMMON

    w = tuned
    args = ["calibrate", str(w / "tuned"), "--val-data", str(w / "train.csv"), "--data", str(w / "train.csv")]
    args += ["--flag-score", "mds", *COMMON]
    assert main([*args, "--engine", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    on_ray, local = (saved_calibration(load_any(str(tmp_path / name))) for name in ("ray", "local"))
    assert on_ray.statistics.scores == MERGEABLE_SCORES and on_ray.score == local.score == "mds"
    for key, value in on_ray.statistics.tensors.items():
        expected = local.statistics.tensors[key]
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())
    assert on_ray.threshold == pytest.approx(local.threshold, rel=1e-9)
    assert on_ray.temperature == local.temperature and on_ray.set_quantiles == local.set_quantiles
    assert on_ray.statistics_data == str(w / "train.csv") and len(on_ray.statistics_data_sha256) == 64
