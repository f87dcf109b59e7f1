"""The tiny saved model and corpus the Ray tests score."""

from __future__ import annotations

import pytest

from hydra_cli import main
from tests.factories import tiny_vit_and_photos

COMMON = ["--batch-size", "8", "--max-length", "12"]


@pytest.fixture(scope="session")
def tuned(tmp_path_factory):
    """A tiny fine-tuned classifier saved with a conformal calibration on mds and its statistics,
    and a corpus of ID-like and OOD-like texts in two files."""
    from tests.cli.test_pipeline import _model_and_tokenizer

    w = tmp_path_factory.mktemp("ray")
    _model_and_tokenizer("bert", w / "model")
    rows = [f"goal match team score {i},sport" for i in range(12)]
    rows += [f"bank shares market profit {i},money" for i in range(12)]
    (w / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv"), "--epochs", "1"]
    # trained in fp32 in every run: the model is the subject, the engines' precision the test's
    finetune = ["finetune", str(w / "model"), *data, "--precision", "fp32", "--out", str(w / "tuned")]
    assert main([*finetune, *COMMON]) == 0
    (w / "corpus").mkdir()
    for part, start in (("a", 0), ("b", 1)):
        texts = [
            f"goal match team score {i}" if i % 3 else f"recipe with flour {i}" for i in range(start, 90, 2)
        ]
        (w / "corpus" / f"{part}.csv").write_text("text\n" + "\n".join(texts) + "\n")
    return w


@pytest.fixture(scope="module")
def embedded():
    """Ray embedded in this test process, as the command starts it (shared by the module's tests)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vit(tmp_path_factory):
    """A tiny calibrated ViT with its image processor, and a folder of its validation images."""
    root = tmp_path_factory.mktemp("vit")
    photos = tiny_vit_and_photos(root, 12, named=True)
    args = ["calibrate", str(root / "vit"), "--val-data", photos, "--data", photos, "--flag-score", "mds"]
    assert main([*args, "--out", str(root / "calibrated")]) == 0
    return root
