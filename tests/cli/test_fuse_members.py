"""``hydra-ens fuse --members``: a deep ensemble of fine-tunes of one pretrained model, each
keeping every head, fused into one model that predicts like the explicit ensemble; calibrated and
served like any saved model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.fusion import HydraModel
from hydra_ensembles.loading import load_any
from tests.cli.test_pipeline import _model_and_tokenizer

COMMON = ["--batch-size", "8", "--max-length", "12"]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    w = tmp_path_factory.mktemp("deep")
    _model_and_tokenizer("bert", w / "model")
    rows = [f"goal match team score {i},sport" for i in range(12)]
    rows += [f"bank shares market profit {i},money" for i in range(12)]
    (w / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    (w / "new.csv").write_text("text\n" + "\n".join(f"recipe with flour {i} goal" for i in range(10)) + "\n")
    data = ["--data", str(w / "train.csv"), "--epochs", "1", *COMMON]
    for seed in range(3):
        out = str(w / f"m{seed}")
        assert main(["finetune", str(w / "model"), *data, "--seed", str(seed), "--out", out]) == 0
    return w


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fused_deep_ensemble_predicts_like_its_members_and_is_calibrated_and_served(
    members, tmp_path, capsys
):
    w = members
    paths = [str(w / f"m{seed}") for seed in range(3)]
    assert main(["fuse", "--members", *paths, "--out", str(tmp_path / "fused")]) == 0
    fused = load_any(str(tmp_path / "fused"))
    assert isinstance(fused, HydraModel) and fused.num_members == 3
    assert "no calibration yet" in capsys.readouterr().out
    outs = {"fused": tmp_path / "fused.jsonl", "explicit": tmp_path / "explicit.jsonl"}
    for name, model in (("fused", str(tmp_path / "fused")), ("explicit", ",".join(paths))):
        assert main(["predict", model, "--data", str(w / "new.csv"), "--out", str(outs[name]), *COMMON]) == 0
    fused_rows, explicit_rows = _records(outs["fused"]), _records(outs["explicit"])
    for a, b in zip(fused_rows, explicit_rows, strict=True):  # fp32: the same sums in another order
        assert a["predicted"] == b["predicted"]
        for key in ("p_money", "p_sport", "entropy", "mutual_information"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    calibrated = tmp_path / "calibrated"
    args = [
        "calibrate",
        str(tmp_path / "fused"),
        "--val-data",
        str(w / "train.csv"),
        "--data",
        str(w / "train.csv"),
    ]
    assert main([*args, "--out", str(calibrated), *COMMON]) == 0
    calibration = saved_calibration(load_any(str(calibrated)))
    assert calibration is not None and calibration.flag.statistics.num_members == 3
    out = tmp_path / "served.jsonl"
    assert main(["predict", str(calibrated), "--data", str(w / "new.csv"), "--out", str(out), *COMMON]) == 0
    assert f"ood_score_{calibration.flag.score}" in _records(out)[0]


def test_fuse_refuses_mixed_and_single_members(members, tmp_path, capsys):
    w = members
    cases = [
        (["fuse", "--members", str(w / "m0"), "--out", str(tmp_path / "o")], "two saved members"),
        (["fuse", str(w / "model"), "--members", str(w / "m0"), str(w / "m1"), "--out", str(tmp_path / "o")],
         "give no MODEL"),
        (["fuse", str(w / "model"), "--out", str(tmp_path / "o")], "give MODEL with --heads"),
    ]  # fmt: skip
    for args, message in cases:
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
