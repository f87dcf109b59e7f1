"""Corruptions, temperature scaling, predictions and the evaluation summary."""

import difflib

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.data import ImageDataset, TextDataset
from hydra_ensembles.evaluation import (
    IMAGE_CORRUPTIONS,
    SEVERITIES,
    TEXT_CORRUPTIONS,
    Predictions,
    corrupt_images,
    corrupt_texts,
    evaluate_predictions,
    fit_temperature,
    predict,
)
from tests.factories import labelled, text_inputs, tiny_bert


def _images():
    rng = np.random.default_rng(0)
    return ImageDataset(rng.random((4, 1, 12, 12)).astype(np.float32), [0, 1, 0, 1], list("abcd"), ["x", "y"])


@pytest.mark.parametrize("name", sorted(IMAGE_CORRUPTIONS))
def test_image_corruptions_grow_with_severity_and_are_seeded(name):
    data = _images()
    distances = []
    for severity in SEVERITIES:
        out = corrupt_images(data, name, severity, seed=1)
        assert out.images.shape == data.images.shape and out.labels == data.labels
        assert out.images.min() >= 0 and out.images.max() <= 1 + 1e-6
        assert np.array_equal(out.images, corrupt_images(data, name, severity, seed=1).images)
        distances.append(np.abs(out.images - data.images).mean())
    assert distances[-1] > distances[0] > 0


@pytest.mark.parametrize("name", sorted(TEXT_CORRUPTIONS))
def test_text_corruptions_grow_with_severity_and_are_seeded(name):
    text = " ".join(f"word{i} alpha beta gamma" for i in range(40))
    data = TextDataset([text, text], [0, 1], ["a", "b"], ["x", "y"])
    changed = []
    for severity in SEVERITIES:
        out = corrupt_texts(data, name, severity, seed=3)
        assert out.texts == corrupt_texts(data, name, severity, seed=3).texts
        assert out.texts[0] != out.texts[1]  # seeded by item id
        matcher = difflib.SequenceMatcher(a=out.texts[0].split(), b=text.split(), autojunk=False)
        changed.append(1 - matcher.ratio())
    assert changed[-1] > changed[0]


def test_unknown_corruption_and_severity():
    with pytest.raises(ValueError, match="unknown image corruption"):
        corrupt_images(_images(), "fog", 1)
    with pytest.raises(ValueError, match="severity"):
        corrupt_images(_images(), "contrast", 6)


def test_temperature_scaling_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    true_logits = rng.normal(size=(4000, 5)) * 2
    labels = np.array([rng.choice(5, p=np.exp(r) / np.exp(r).sum()) for r in true_logits])
    overconfident = Predictions(true_logits[None] * 3.0, labels)  # logits 3x too sharp
    t = fit_temperature(overconfident)
    assert t == pytest.approx(3.0, rel=0.1)
    per_member = fit_temperature(Predictions(np.stack([true_logits * 3.0, true_logits * 0.5]), labels), True)
    assert per_member[0] == pytest.approx(3.0, rel=0.1) and per_member[1] == pytest.approx(0.5, rel=0.1)
    before = he.metrics.nll(overconfident.probs(), labels)
    assert he.metrics.nll(overconfident.probs(t), labels) < before
    with pytest.raises(ValueError, match="labelled"):
        fit_temperature(Predictions(true_logits[None]))


def test_predict_single_ensemble_hydra_and_mc_dropout():
    model = tiny_bert()
    data = [labelled(text_inputs(seed=s), seed=s) for s in range(2)]
    single = predict(model, data, progress=False)
    assert single.member_logits.shape == (1, 8, 3) and single.labels.shape == (8,)
    hydra = he.fuse(model, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})])
    assert predict(hydra, data, progress=False).member_logits.shape == (2, 8, 3)
    assert predict([model, model], data, progress=False).num_members == 2
    torch.manual_seed(0)
    mc = predict(model, data, progress=False, mc_samples=3)
    assert mc.num_members == 3 and not np.allclose(mc.member_logits[0], mc.member_logits[1])
    assert not model.training


def test_evaluate_predictions_summary():
    rng = np.random.default_rng(1)
    id_preds = Predictions(rng.normal(size=(2, 50, 3)) * 3, rng.integers(0, 3, 50))
    near = Predictions(rng.normal(size=(2, 20, 3)))
    far = Predictions(rng.normal(size=(2, 30, 3)) * 0.1)
    result = evaluate_predictions(id_preds, {"n": ("near", near), "f": ("far", far)})
    summary = result["ood_summary"]["msp"]
    assert summary["average"]["auroc"] == pytest.approx(
        (summary["near"]["auroc"] + summary["far"]["auroc"]) / 2
    )
    with pytest.raises(ValueError, match="near' or 'far"):
        evaluate_predictions(id_preds, {"x": ("medium", near)})


def test_a_temperature_the_validation_data_cannot_set_is_not_sent_to_zero():
    """A single model with no validation error, or an ensemble whose every error has a dissenting
    member, has an NLL that keeps falling as T -> 0 (one-hot votes); the fit keeps T = 1 and
    says so instead of returning a temperature that makes every prediction certain."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 120)
    single = rng.normal(size=(1, 120, 3))
    single[0, np.arange(120), labels] += 10.0  # every input right
    with pytest.warns(UserWarning, match="cannot set a temperature"):
        assert fit_temperature(Predictions(single, labels)) == 1.0
    members = np.repeat(single, 3, axis=0)
    wrong = (labels[:4] + 1) % 3
    members[1, np.arange(4), wrong] += 20.0  # four errors, each with two members dissenting
    with pytest.warns(UserWarning, match="cannot set a temperature"):
        assert fit_temperature(Predictions(members, labels)) == 1.0
    members[:, 4, (labels[4] + 1) % 3] += 20.0  # a unanimous error: the data sets a temperature
    fitted = fit_temperature(Predictions(members, labels))
    assert 0.05 <= fitted < 10


def test_the_report_names_a_score_that_ranks_ood_as_more_in_distribution():
    from hydra_ensembles.reporting.ood_sections import inverted_note

    assert inverted_note({"A": {"msp": 0.8, "rmds": 0.04}, "B": {"msp": 0.7, "rmds": None}}) != []
    note = inverted_note({"A": {"msp": 0.8, "rmds": 0.04}})[0]
    assert note.startswith("Inverted here: rmds") and "msp" not in note.split("(")[0]
    assert inverted_note({"A": {"msp": 0.8, "mds": 0.5}}) == []
