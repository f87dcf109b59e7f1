"""The one label parser and the data validators: one class per label however it is written,
every missing or malformed label refused, columns as named, pixels in their own range."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hydra_ensembles.data import load_image_folder, load_npz, load_text_table
from hydra_ensembles.data.labels import MAX_CLASS_ID, check_trainable, parse_labels


@pytest.mark.parametrize(
    ("values", "labels", "classes"),
    [
        ([0, "0", " 0 ", 0.0, "0.0", 1, "1"], [0, 0, 0, 0, 0, 1, 1], ["0", "1"]),
        (["pos ", "pos", " neg"], [1, 1, 0], ["neg", "pos"]),
        ([np.int64(2), np.float32(0.0)], [2, 0], ["0", "1", "2"]),
        ([MAX_CLASS_ID, 0], [MAX_CLASS_ID, 0], None),
    ],
)
def test_one_class_however_a_label_is_written(values, labels, classes):
    got, names = parse_labels(values, "f", "label")
    assert got == labels
    if classes is not None:
        assert names == classes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([0, None], "no 'label' (first: row 2)"),
        ([0, float("nan")], "no 'label'"),
        (["a", "NaN"], "no 'label'"),
        (["a", "  "], "no 'label'"),
        ([0, 1.7], "row 2: the 'label' 1.7 is not a class id"),
        (["0", "2.5"], "not a class id"),
        ([0, float("inf")], "not a class id"),
        ([-1, 0], ">= 0"),
        ([0, MAX_CLASS_ID + 1], "implausible"),
        ([0, "cat"], "mixes class ids"),
        ([0, [1]], "not a class id or a class name"),
        ([True, False], "row 1: the 'label' True (a boolean) is not a class id"),
    ],
)
def test_every_missing_or_malformed_label_is_refused(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_labels(values, "f", "label")


def test_training_needs_two_classes():
    check_trainable([0, 1, 0], ["a", "b"], "f")
    with pytest.raises(ValueError, match="every label is 'b'"):
        check_trainable([1, 1], ["a", "b"], "f")


def test_tables_use_the_one_parser(tmp_path):
    file = tmp_path / "d.csv"
    file.write_text("text,label\na,0\nb,0.0\nc, 1\n")
    assert load_text_table(file).labels == [0, 0, 1]
    file = tmp_path / "d.jsonl"
    file.write_text(
        "\n".join(json.dumps({"text": t, "label": y}) for t, y in [("a", "x "), ("b", "x"), ("c", "y")])
    )
    data = load_text_table(file)
    assert data.classes == ["x", "y"] and data.labels == [0, 0, 1]
    file = tmp_path / "extra.csv"
    file.write_text("text,label\ngood,0\nbad, text,1\n")
    with pytest.raises(ValueError, match="line 3: 3 fields where the header has 2"):
        load_text_table(file)


def test_hugging_face_columns_are_used_as_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hydra_ensembles.data.hf import load_hf

    pq.write_table(pa.table({"body": ["goal", "bank"], "topic": ["sport", "money"]}), tmp_path / "a.parquet")
    data = load_hf(str(tmp_path / "a.parquet"), label_column="topic")  # the text: its only other string
    assert data.texts == ["goal", "bank"] and data.classes == ["money", "sport"]
    with pytest.raises(ValueError, match="no column 'txt'"):
        load_hf(str(tmp_path / "a.parquet"), text_column="txt", label_column="topic")
    with pytest.raises(ValueError, match="cannot tell which column holds the labels"):
        load_hf(str(tmp_path / "a.parquet"))
    unlabelled = load_hf(str(tmp_path / "a.parquet"), text_column="body", labelled=False)
    assert unlabelled.classes == [] and unlabelled.texts == ["goal", "bank"]
    pq.write_table(pa.table({"text": [3, 4], "label": ["a", "b"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="'text' holds int64, not text"):
        load_hf(str(tmp_path / "b.parquet"))


def test_sixteen_bit_images_keep_their_range(tmp_path):
    from PIL import Image

    for name, value in (("dark", 1000), ("bright", 60000)):
        (tmp_path / name).mkdir()
        Image.fromarray(np.full((4, 4), value, np.uint16)).save(tmp_path / name / "a.png")
    data = load_image_folder(tmp_path, grayscale=True)
    assert data.images[data.classes.index("dark")].max() == pytest.approx(1000 / 65535)
    assert data.images[data.classes.index("bright")].max() == pytest.approx(60000 / 65535)
    rgb = load_image_folder(tmp_path, size=2)
    assert rgb.images.shape == (2, 3, 2, 2) and rgb.images.min() > 0 and rgb.images.max() < 1


def test_a_decompression_bomb_is_refused(tmp_path, monkeypatch):
    from PIL import Image

    (tmp_path / "a").mkdir()
    Image.new("L", (16, 16)).save(tmp_path / "a" / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 256 pixels > twice the limit
    with pytest.raises(ValueError, match=r"bomb\.png is not a readable image"):
        load_image_folder(tmp_path)


def test_npz_pixels_and_labels_are_checked(tmp_path):
    x = np.zeros((2, 4, 4), np.float32)
    np.savez(tmp_path / "named.npz", x=x, y=np.array([0, 2]), classes=np.array(["a", "b"]))
    with pytest.raises(ValueError, match="class id 2 in y has no name"):
        load_npz(tmp_path / "named.npz")
    np.savez(tmp_path / "float.npz", x=x + 0.5, y=np.array([0.0, 1.0]))
    data = load_npz(tmp_path / "float.npz")
    assert data.labels == [0, 1] and data.images.max() == 0.5


def test_a_table_is_numbered_by_the_models_classes_when_given(tmp_path):
    """A validation file holding only "positive" rows: by the file's own names it would be class
    0, which the model calls "negative"; by the model's classes it is class 1."""
    file = tmp_path / "val.csv"
    file.write_text("text,label\ngreat,positive\nsuperb,positive\n")
    assert load_text_table(file).labels == [0, 0]  # the file's own names, sorted
    data = load_text_table(file, classes=["negative", "positive"])
    assert data.labels == [1, 1] and data.classes == ["negative", "positive"]
    with pytest.raises(ValueError, match=r"classes \['positive'\] are not classes of the model"):
        load_text_table(file, classes=["neg", "pos"])
