"""The feature statistics of every built-in score (the Mahalanobis scores, kNN, ViM, the layer
scores) fit on Ray over training data split into files of uneven sizes equal the one-process fit
on the same rows to 1e-10 relative in float64 (ViM within its Davis-Kahan bound, where that is
larger; the members' features are computed in the same batches, so only the order of the sums
differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hydra_ensembles.data import load_spec, model_batches
from hydra_ensembles.evaluation import predict
from hydra_ensembles.loading import load_any, load_preprocessor
from hydra_ensembles.members.ensemble import as_ensemble
from hydra_ensembles.ood import FeatureStatistics
from hydra_ensembles.ood.features import ensemble_heads
from tests.ood.test_passes import _davis_kahan, _projector

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
    heads = ensemble_heads(as_ensemble(model))
    got = fit_statistics_dataset(
        model_path, files, RayPlan(2, 1, True), classes=["money", "sport"], num_labels=2, heads=heads,
        batch_size=8, max_length=12, precision="fp32",
    )  # fmt: skip
    features, layers, labels = [], [], []
    for file in files:
        _, batches = model_batches(load_spec(str(file)), model, load_preprocessor(model_path), 8, 12)
        preds = predict(model, batches, progress=False, precision="fp32", layers=True)
        features.append(preds.member_features)
        layers.append(preds.layer_features)
        labels += preds.class_labels().tolist()
    x = np.concatenate(features, 1).astype(np.float64)
    expected = FeatureStatistics.fit(
        x, np.asarray(labels), 2, heads, layer_features=np.concatenate(layers, 1)
    )
    assert {"mds", "rmds", "mds++", "knn", "vim", "mds_layers"} <= set(expected.scores)
    assert got.settings == expected.settings and set(got.tensors) == set(expected.tensors)
    vim = max(1e-10, _davis_kahan(x, expected))
    for key, value in expected.tensors.items():
        mine, rtol = got.tensors[key], vim if key.startswith("vim.") else 1e-10
        if key == "vim.basis":
            mine, value = _projector(mine), _projector(value)
        torch.testing.assert_close(mine, value, rtol=rtol, atol=rtol * value.abs().max().item(), msg=key)


def test_calibrate_on_ray_saves_the_calibration_one_process_fits(tuned, embedded, tmp_path):
    """calibrate --engine ray --data: the statistics (of every score), threshold and sets of
    calibrate without it, on the same rows (one file: the same batches); the data named by its
    files' digest."""
    from hydra_cli import main
    from hydra_ensembles.calibration import saved_calibration
    from tests.distributed.conftest import COMMON

    w = tuned
    args = ["calibrate", str(w / "tuned"), "--val-data", str(w / "train.csv"), "--data", str(w / "train.csv")]
    args += ["--flag-score", "mds", *COMMON]
    assert main([*args, "--engine", "ray", "--out", str(tmp_path / "ray")]) == 0
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    on_ray, local = (saved_calibration(load_any(str(tmp_path / name))) for name in ("ray", "local"))
    assert (
        on_ray.flag.statistics.scores == local.flag.statistics.scores
        and on_ray.flag.score == local.flag.score == "mds"
    )
    for key, value in on_ray.flag.statistics.tensors.items():
        if key.startswith("vim."):
            continue  # within its Davis-Kahan bound: the test above
        expected = local.flag.statistics.tensors[key]
        torch.testing.assert_close(
            value, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item(), msg=key
        )
    assert on_ray.flag.threshold == pytest.approx(local.flag.threshold, rel=1e-9)
    assert on_ray.temperature == local.temperature and on_ray.sets.quantiles == local.sets.quantiles
    assert (
        on_ray.provenance.statistics.name == str(w / "train.csv")
        and len(on_ray.provenance.statistics.sha256) == 64
    )


def test_build_on_ray_saves_the_calibrations_build_saves_in_one_process(tuned, embedded, tmp_path, capsys):
    """build --engine ray --fine-tune: the fused model's and the members' ensemble's feature
    statistics fit on Ray equal those build fits in one process (same members: fp32, one seed),
    and so do their flag scores and thresholds; the model copies saved for the workers are gone."""
    from hydra_cli import main
    from hydra_ensembles.calibration import saved_calibration
    from tests.distributed.conftest import COMMON

    w, data = tuned, ["--data", str(tuned / "train.csv")]
    scores = tmp_path / "taylor.json"
    assert main(["score", str(w / "tuned"), "--method", "taylor", "--heads-per-layer", "2", *data,
                 "--out", str(scores), *COMMON]) == 0  # fmt: skip
    args = ["build", str(w / "tuned"), "--scores", str(scores), "--members", "2", "--num-pruned", "2"]
    args += ["--fine-tune", *data, "--val-data", str(w / "train.csv"), "--epochs", "1", "--precision", "fp32"]
    assert main([*args, "--engine", "ray", "--out", str(tmp_path / "ray"), *COMMON]) == 0
    assert "fitting the feature statistics on 1 file(s)" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "local"), *COMMON]) == 0
    assert not (tmp_path / "ray" / "checkpoints").exists()
    for part in ("hydra", "members"):
        on_ray, local = (saved_calibration(load_any(str(tmp_path / run / part))) for run in ("ray", "local"))
        assert (
            on_ray.flag.statistics.scores == local.flag.statistics.scores
            and on_ray.flag.score == local.flag.score
        )
        assert (
            on_ray.provenance.statistics.name == str(w / "train.csv")
            and len(on_ray.provenance.statistics.sha256) == 64
        )
        for key, value in on_ray.flag.statistics.tensors.items():
            if key.startswith("vim."):
                continue  # within its Davis-Kahan bound: the first test
            expected = local.flag.statistics.tensors[key]
            torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())
        assert on_ray.flag.threshold == pytest.approx(local.flag.threshold, rel=1e-9)
