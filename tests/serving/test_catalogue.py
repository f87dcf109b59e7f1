"""The served paths' catalogue: what the pipelines must refuse in one line (as `hydra-ens predict`
refuses it), and texts longer than the model's positions, truncated as documented."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, pipeline

import hydra_ensembles as he
from hydra_ensembles.models import load_tokenizer

from .conftest import CLASSES, HEAD_SETS, tiny_image_classifier

TEXT_REFUSALS = [
    ("empty", "", "empty text"),
    ("blank", "  \n", "empty text"),
    ("none", None, "got NoneType"),
    ("number", 5, "got int"),
    ("nested-object", {"text": {"a": 1}}, "got dict"),
    ("list-with-an-empty-text", ["a text", ""], "empty text"),
]


@pytest.mark.parametrize(("case", "value", "fragment"), TEXT_REFUSALS, ids=[c[0] for c in TEXT_REFUSALS])
@pytest.mark.parametrize("kind", ["calibrated", "ensemble"])
def test_the_text_pipeline_refuses_what_predict_refuses(saved, kind, case, value, fragment):
    served = pipeline("hydra-text-classification", model=str(saved[kind]))
    with pytest.raises(ValueError, match=fragment) as raised:
        served(value)
    assert "\n" not in str(raised.value)


def test_a_text_longer_than_the_positions_is_truncated_to_them(tmp_path):
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=12, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
        max_position_embeddings=32, id2label=CLASSES, label2id={v: k for k, v in CLASSES.items()},
    )  # fmt: skip
    base = BertForSequenceClassification(config).eval()
    folder = tmp_path / "hydra"
    tokenizer = load_tokenizer()  # it knows 512 positions, the model 32
    tokenizer.save_pretrained(folder)
    he.fuse(base, list(HEAD_SETS)).save_pretrained(folder)
    long = " ".join(["market"] * 100)
    served = pipeline("hydra-text-classification", model=str(folder))
    record = served(long)[0] if isinstance(served(long), list) else served(long)
    cut = tokenizer.decode(
        tokenizer(long, truncation=True, max_length=32)["input_ids"], skip_special_tokens=True
    )
    expected = served(cut)
    expected = expected[0] if isinstance(expected, list) else expected
    assert record["confidence"] == pytest.approx(expected["confidence"], abs=1e-6)
    explicit = pipeline("hydra-text-classification", model=str(folder), truncation=True, max_length=16)
    assert explicit(long)  # what the caller asks for wins


@pytest.mark.parametrize("value", [None, "", "  ", "a photo of a cat", [None]])
def test_the_image_pipeline_refuses_what_is_no_image(tmp_path, value):
    folder = tmp_path / "vit"
    model = tiny_image_classifier()
    he.fuse(model, [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2]})]).save_pretrained(folder)
    from transformers import ViTImageProcessor

    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(folder)
    served = pipeline("hydra-image-classification", model=str(folder))
    with pytest.raises(ValueError, match="takes images"):
        served(value)


def test_a_garbled_config_json_of_a_saved_folder_is_one_clear_error(saved, tmp_path):
    """config.json only routes the Auto classes to the library's loader: garbled, it is refused
    with a ValueError that says so (not an AttributeError from deep inside transformers)."""
    import json
    import shutil

    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "garbled"
    shutil.copytree(saved["calibrated"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "id2label": "junk"}))
    with pytest.raises(ValueError, match=r"malformed config\.json of a hydra-ens folder"):
        AutoModelForSequenceClassification.from_pretrained(folder)


def _served_vit(folder):
    from transformers import ViTImageProcessor

    he.fuse(tiny_image_classifier(), [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2]})]).save_pretrained(folder)
    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(folder)
    return pipeline("hydra-image-classification", model=str(folder))


def test_the_image_pipeline_refuses_images_no_model_should_be_served(tmp_path):
    """Empty images, float pixels outside [0, 1] or not finite, decompression bombs, files that are
    no image, and batch sizes below 1: one line each, as the command line refuses them."""
    import numpy as np
    from PIL import Image

    served = _served_vit(tmp_path / "vit")
    refusals = [
        (Image.new("RGB", (0, 0)), r"empty \(0 x 0 pixels\)"),
        (np.zeros((0, 8, 3), np.uint8), "empty"),
        (np.full((8, 8, 3), 2.0, np.float32), r"float pixels must lie in \[0, 1\]"),
        (np.full((8, 8, 3), np.nan, np.float32), "not finite"),
    ]
    for value, fragment in refusals:
        with pytest.raises(he.InputError, match=fragment) as raised:
            served(value)
        assert "\n" not in str(raised.value)
    (tmp_path / "not-an-image.png").write_bytes(b"no image at all")
    with pytest.raises(he.InputError, match="not a readable image"):
        served(str(tmp_path / "not-an-image.png"))
    bomb = tmp_path / "bomb.png"
    Image.new("L", (64, 64)).save(bomb)
    limit = Image.MAX_IMAGE_PIXELS
    try:
        Image.MAX_IMAGE_PIXELS = 64 * 64 // 4  # a 64 x 64 file is a bomb at this limit
        with pytest.raises(he.InputError, match=r"not a readable image|past the"):
            served(str(bomb))
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    image = Image.new("RGB", (8, 8))
    for size in (0, -1):
        with pytest.raises(he.InputError, match="batch_size must be a positive whole number"):
            served([image, image], batch_size=size)
    assert served(image)  # a good image is served
