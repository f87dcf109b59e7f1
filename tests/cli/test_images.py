"""Image models that ship an image processor (as pretrained checkpoints do): the CLI resizes,
gives grey images the model's three channels and normalises them with it."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

try:  # transformers releases with a torchvision backend name the PIL one apart
    from transformers import ViTImageProcessorPil as ViTProcessor
except ImportError:  # pragma: no cover - older 5.x releases
    from transformers import ViTImageProcessor as ViTProcessor

from hydra_cli import main
from hydra_ensembles.data import ImageDataset, to_batches
from hydra_ensembles.evaluation import predict
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_image_processor
from tests.factories import tiny_vit_and_photos

MEAN, STD = [0.2, 0.4, 0.6], [0.5, 0.25, 0.125]


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory):
    """A 16 x 16 RGB ViT with its processor, and 8 x 8 grey images with labels in an .npz."""
    root = tmp_path_factory.mktemp("rgb")
    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=25,
        image_size=16,
        patch_size=8,
        num_channels=3,
        num_labels=2,
        initializer_range=0.3,
    )
    ViTForImageClassification(config).save_pretrained(root / "model")
    ViTForImageClassification(config).save_pretrained(root / "bare")  # no processor (trained here)
    processor = ViTProcessor(size={"height": 16, "width": 16}, image_mean=MEAN, image_std=STD)
    processor.save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (10, 8, 8), dtype=np.uint8)
    np.savez(root / "images.npz", x=grey, y=rng.integers(0, 2, 10))
    return root


def test_processor_resizes_repeats_channels_and_normalises(rgb_model):
    processor = load_image_processor(str(rgb_model / "model"))
    grey = np.full((2, 1, 8, 8), 0.5, dtype=np.float32)
    (batch,) = to_batches(ImageDataset(grey, [0, 1], ["a", "b"], ["x", "y"]), processor)
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    expected = (0.5 - torch.tensor(MEAN)) / torch.tensor(STD)  # a flat image stays flat when resized
    # within one 8-bit step (the PIL backend resizes in uint8), divided by the std
    torch.testing.assert_close(batch["pixel_values"][0, :, 3, 5], expected, atol=1.01 / 255 / 0.125, rtol=0)
    assert load_image_processor(str(rgb_model / "bare")) is None  # pixels then only go to [-1, 1]


def test_predict_on_grey_images_with_an_rgb_model(rgb_model, capsys):
    out = rgb_model / "predictions.csv"
    data = ["--data", str(rgb_model / "images.npz"), "--labelled"]
    assert main(["predict", str(rgb_model / "model"), *data, "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 10 and {"p_0", "p_1", "label", "correct"} <= set(rows[0])
    assert "10 predictions" in capsys.readouterr().out


@pytest.mark.same_in_every_precision  # built, predicted, served and exported in fp32, as asked
def test_a_fused_deep_ensemble_of_vits_is_served_alike_by_predict_the_image_pipeline_and_onnx(tmp_path):
    """build --num-pruned 0 --fine-tune on an image folder: the fused deep ensemble of two tiny ViTs
    predicts what its saved members predict one by one, and predict, the image pipeline and the
    exported ONNX graph give each image the same flag score and class."""
    import onnxruntime
    from PIL import Image
    from transformers import pipeline

    from hydra_ensembles.serving.onnx import TOLERANCE

    photos = tiny_vit_and_photos(tmp_path, 8, named=True)
    common = ["--batch-size", "8", "--precision", "fp32"]
    args = ["build", str(tmp_path / "vit"), "--members", "2", "--num-pruned", "0", "--fine-tune"]
    args += ["--epochs", "1", "--data", photos, "--val-data", photos, "--flag-score", "mds"]
    assert main([*args, *common, "--out", str(tmp_path / "built")]) == 0
    folder = tmp_path / "built" / "hydra"
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(folder), "--data", photos, "--out", str(out), *common]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    scores = [r["ood_score_mds"] for r in rows]
    images = [Image.open(Path(photos) / r["id"]).convert("RGB") for r in rows]
    served = pipeline("hydra-image-classification", model=str(folder), precision="fp32")(images)
    assert [r["ood_score_mds"] for r in served] == pytest.approx(scores, rel=1e-5)
    assert [r["predicted"] for r in served] == [r["predicted"] for r in rows]
    pixels = load_image_processor(str(folder))(images, return_tensors="pt")["pixel_values"]
    batches = [{"pixel_values": pixels}]
    fused, members = load_any(str(folder)), load_any(str(tmp_path / "built" / "members"))
    torch.testing.assert_close(
        torch.as_tensor(predict(fused, batches, progress=False, precision="fp32").member_logits),
        torch.as_tensor(predict(members, batches, progress=False, precision="fp32").member_logits),
        rtol=1e-5,
        atol=1e-5,
    )
    assert main(["export", str(folder), "--format", "onnx", "--out", str(tmp_path / "onnx")]) == 0
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    (graph,) = session.run(["ood_score"], {"pixel_values": pixels.numpy()})
    assert graph.tolist() == pytest.approx(scores, rel=TOLERANCE)
