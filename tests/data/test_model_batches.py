"""`data.model_batches`: data checked against the model, labels numbered as its classes."""

import numpy as np
import pytest

from hydra_ensembles.data import ImageDataset, TextDataset, model_batches, to_batches
from hydra_ensembles.models import load_tokenizer
from tests.factories import tiny_bert, tiny_vit


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("minilm-l6")


def _texts(classes):
    return TextDataset(["a b", "c d e", "f"], [0, 1, 0], ["x", "y", "z"], classes)


def test_labels_follow_the_models_class_names(tokenizer):
    model = tiny_bert(labels=2)
    model.config.id2label = {0: "sport", 1: "news"}
    model.config.label2id = {"sport": 0, "news": 1}
    dataset, batches = model_batches(_texts(["news", "sport"]), model, tokenizer, batch_size=2, max_length=16)
    assert dataset.classes == ["sport", "news"] and dataset.labels == [1, 0, 1]
    assert [b["labels"].tolist() for b in batches] == [[1, 0], [1]]
    # the same as batching the aligned data directly
    direct = list(to_batches(dataset, tokenizer, 2, 16))
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(batches, direct, strict=True))


def test_unlabelled_batches_carry_model_inputs_only(tokenizer):
    unlabelled = TextDataset(["a", "b"], [0, 0], ["x", "y"], [])
    _, batches = model_batches(unlabelled, tiny_bert(), tokenizer, labelled=False, max_length=16)
    assert "labels" not in batches[0]
    with pytest.raises(ValueError, match=r"ood\.csv has no labels"):
        model_batches(unlabelled, tiny_bert(), tokenizer, name="ood.csv")


def test_refusals_name_the_data(tokenizer):
    images = ImageDataset(np.zeros((2, 1, 28, 28), np.float32), [0, 1], ["a", "b"], ["x", "y"])
    with pytest.raises(ValueError, match="pics holds images, but the model takes text"):
        model_batches(images, tiny_bert(), tokenizer, name="pics")
    with pytest.raises(ValueError, match=r"t\.csv holds texts, but the model takes images"):
        model_batches(_texts(["0", "1"]), tiny_vit(), None, name="t.csv")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        model_batches(_texts(["0", "1"]), tiny_bert(), None)
    positions = tiny_bert().config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's {positions} positions"):
        model_batches(_texts(["0", "1"]), tiny_bert(), tokenizer, max_length=positions + 1)
