"""A model calibrated on a feature score serves the same score and flag everywhere: the library's
records on `predict`'s predictions, `pipeline("hydra-text-classification")` and the exported ONNX
graph (which computes the score itself, from the statistics saved with the model); the statistics
are refused for other weights and when edited."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime
import pytest
import torch
from transformers import pipeline

import hydra_ensembles as he
from hydra_ensembles.calibration import calibrate, saved_calibration
from hydra_ensembles.evaluation import predict
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.ood import STATISTICS_NAME, FeatureStatistics, feature_scores
from hydra_ensembles.serving.onnx import export_onnx

from .conftest import HEAD_SETS, tiny_text_classifier, validation

# one pytest-xdist worker: each score's model is calibrated and exported once, for every test
pytestmark = pytest.mark.xdist_group("feature-scores")

EXPORTED = ("mds", "knn", "vim", "mds_layers", "mds_disagreement")
"""The scores whose graphs are exported: between them every operation the scores use (rmds and
mds++ are mds's matrix products and knn's normalisation; mds_layers reads every layer's token,
mds_disagreement the members' spread of it)."""
TEXTS = ["goal match team score", "bank shares market", "rain and wind tomorrow", "a recipe with flour"]
TEXTS += ["the quarterly report", "snow later", "an unrelated sentence about poetry", "x y z"]


def _train(tokenizer):
    words = ("goal", "match", "bank", "shares", "rain", "wind")
    texts = [f"{words[i % 6]} {words[(i * 5) % 6]} {i}" for i in range(90)]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    return [{**batch, "labels": torch.tensor([(i % 6) // 2 for i in range(90)])}]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per feature score, a fused model calibrated to flag on it, saved and exported: made when a
    test first asks for that score."""
    root = tmp_path_factory.mktemp("feature-scores")
    tokenizer = load_tokenizer()
    base = tiny_text_classifier()
    members = [he.prune(base, hs) for hs in HEAD_SETS]
    with torch.no_grad():
        for i, member in enumerate(members):  # members that differ everywhere, as fine-tuned ones
            for p in member.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    folders = {}

    def made(score: str):
        if score not in folders:
            model = he.fuse(members)
            calibrate(
                model, validation(tokenizer), score=score, keep=0.8, data="val", precision="fp32",
                progress=False, id_train=_train(tokenizer), train_data="train",
            )  # fmt: skip
            folder = root / score / "hydra"
            tokenizer.save_pretrained(folder)
            model.save_pretrained(folder)
            exported = export_onnx(folder, root / score / "onnx") if score in EXPORTED else None
            folders[score] = (folder, exported)
        return folders[score]

    return made


SLOW_SCORES = ("rmds", "mds++", "knn", "vim", "mds_disagreement")
"""Scores whose served paths are checked under slow (CI runs them): the README's test command
keeps ``mds`` and ``mds_layers`` (one score of the features, one of every layer's tokens, both
exported to ONNX) to stay under ten minutes."""


@pytest.mark.parametrize(
    "score", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SCORES else s for s in feature_scores()]
)
def test_records_pipeline_and_onnx_give_the_same_score_and_flag(built, score):
    folder, exported = built(score)
    model = load_any(str(folder))
    calibration = saved_calibration(model)
    assert calibration.flag.score == score and calibration.flag.statistics is not None
    tokenizer = load_tokenizer(str(folder))
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="pt"))
    layers = calibration.flag.reads_layers
    records = calibration.records(predict(model, [batch], progress=False, precision="fp32", layers=layers))
    expected = np.array([r[f"ood_score_{score}"] for r in records])
    served = pipeline("hydra-text-classification", model=str(folder), precision="fp32")(TEXTS, batch_size=3)
    assert [s[f"ood_score_{score}"] for s in served] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert [s[f"ood_score_{score}_spread"] for s in served] == pytest.approx(
        [r[f"ood_score_{score}_spread"] for r in records], rel=1e-4, abs=1e-6
    )
    if exported is None:
        return
    session = onnxruntime.InferenceSession(str(exported / "model.onnx"))
    sidecar = json.loads((exported / "calibration.json").read_text())
    assert "ood_score" in sidecar["outputs"] and sidecar["calibration"]["flag"]["score"] == score
    feed = {name: batch[name].numpy() for name in sidecar["inputs"]}
    ood, per_member = session.run(["ood_score", "ood_score_per_member"], feed)
    assert ood.dtype == np.float64 and per_member.shape == (len(TEXTS), len(HEAD_SETS))
    assert np.allclose(ood, expected, rtol=1e-4, atol=1e-5)
    assert np.allclose(per_member.mean(1), ood)
    flags = ood > sidecar["calibration"]["flag"]["threshold"]
    kept = np.asarray(
        sidecar["calibration"]["flag"]["calibration_scores"]
    )  # the conformal p-value, as documented
    p_values = (1 + (kept[None] >= ood[:, None]).sum(1)) / (len(kept) + 1)
    assert p_values.tolist() == pytest.approx([r["ood_p_value"] for r in records])
    assert [s["ood_p_value"] for s in served] == pytest.approx([r["ood_p_value"] for r in records])
    clear = np.abs(expected - calibration.flag.threshold) > 1e-4 * max(1.0, abs(calibration.flag.threshold))
    assert flags[clear].tolist() == [r["flagged"] for r, c in zip(records, clear, strict=True) if c]
    assert [s["flagged"] for s in served] == [r["flagged"] for r in records]


def test_the_statistics_are_refused_when_edited_missing_or_from_other_weights(built, tmp_path):
    folder, _ = built("mds")
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    saved = FeatureStatistics.load(copy / STATISTICS_NAME)
    changed = {k: v + 1e-6 if k == "mds.means" else v for k, v in saved.tensors.items()}
    FeatureStatistics(changed, saved.settings).save(copy / STATISTICS_NAME)  # other statistics
    with pytest.raises(ValueError, match="modified after saving"):
        load_any(str(copy))
    (copy / "hydra_config.json").write_text((folder / "hydra_config.json").read_text())
    files = json.loads((copy / "hydra_config.json").read_text())
    assert STATISTICS_NAME in files["files_sha256"]  # covered by the folder's checksums
    (copy / STATISTICS_NAME).unlink()
    with pytest.raises(ValueError, match="missing"):
        load_any(str(copy))
    model = load_any(str(folder))  # the statistics travel with the calibration, bound to the weights
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    with pytest.raises(ValueError, match="fit on other weights"):
        saved_calibration(model)
