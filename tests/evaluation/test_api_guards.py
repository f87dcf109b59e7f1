"""The Python API refuses, with a typed error naming the problem, what would otherwise give a
silently wrong number: inverted probabilities, predictions of two different models scored
together, disagreement of a model with itself, NaN masks, empty or half-labelled inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.evaluation import Predictions, evaluate_predictions, fit_temperature, predict
from hydra_ensembles.evaluation.uncertainty import per_example
from tests.factories import labelled, text_inputs, tiny_bert


def _preds(members=3, n=20, classes=4, seed=0, labels=True):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(members, n, classes)).astype(np.float32)
    return Predictions(logits, rng.integers(0, classes, n) if labels else None)


@pytest.mark.parametrize("temperature", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_is_refused(temperature):
    with pytest.raises(ValueError, match="positive and finite"):
        evaluate_predictions(_preds(), temperature=temperature)
    with pytest.raises(ValueError, match="3 members"):
        _preds().probs(np.array([1.0, 2.0]))


def test_ood_predictions_of_another_model_are_not_scored_with_the_id_ones():
    with pytest.raises(ValueError, match="over 5 classes"):
        evaluate_predictions(_preds(), {"x": ("far", _preds(classes=5, labels=False))})
    with pytest.raises(ValueError, match="1 members"):
        evaluate_predictions(_preds(), {"x": ("far", _preds(members=1, labels=False))})


def test_a_single_model_reports_no_disagreement():
    single = _preds(members=1)
    result = evaluate_predictions(single, {"x": ("far", _preds(members=1, seed=1, labels=False))})
    assert "diversity" not in result
    assert "mutual_information" not in result["ood"]["x"]["scores"]
    record = per_example(single)[0]
    assert "mutual_information" not in record and "members_agreeing" not in record
    assert "mutual_information" in per_example(_preds())[0]
    with pytest.raises(ValueError, match="needs an ensemble"):
        per_example(single, flag_score="mutual_information")


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.array([0, 1, 4]), "out of range: there are 4 classes"),
        (np.array([0, -1, 1]), "out of range"),
        (np.array([0.0, 1.0, 1.0]), "integer class ids"),
        (np.array([0, 1]), "for 3 inputs"),
    ],
)
def test_labels_that_do_not_fit_the_predictions_are_refused(labels, message):
    logits = np.zeros((1, 3, 4), np.float32)
    with pytest.raises(ValueError, match=message):
        fit_temperature(Predictions(logits, labels))


def test_a_nan_in_a_head_mask_is_refused_not_kept():
    with pytest.raises(he.HeadSetError, match="NaN"):
        he.HeadSet.from_mask([[1.0, float("nan")], [0.0, 1.0]])
    assert he.HeadSet.from_mask([[1, 0], [0.0, 1.0]]) == he.HeadSet({0: [0], 1: [1]})


def test_predict_refuses_nothing_and_half_labelled_inputs():
    model = tiny_bert(layers=1, heads=2)
    with pytest.raises(ValueError, match="no batches"):
        predict(model, [], progress=False)
    inputs = text_inputs(batch=4, tokens=5)
    with pytest.raises(ValueError, match="1 batches have labels and 1 do not"):
        predict(model, [labelled(inputs), inputs], progress=False)


def test_float_labels_are_refused_by_circuit_extraction():
    model = tiny_bert(layers=1, heads=2)
    batch = {**text_inputs(batch=4, tokens=5), "labels": torch.tensor([0.0, 1.0, 2.0, 1.0])}
    with pytest.raises(ValueError, match="integer tensor of class ids"):
        he.extract_circuit(model, [batch], budget=1, objective="acc")


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.array([0.5, 1.7, 1.2, 0.0]), "integer class ids"),  # truncated to 0, 1, 1, 0 before
        (np.array([True, False, True, False]), "integer class ids"),  # booleans are no classes
        (np.array([0, 1, 3, 0]), "out of range: there are 3 classes"),
    ],
)
def test_feature_statistics_take_the_labels_every_entry_point_takes(labels, message):
    from hydra_ensembles.ood import FeatureStatistics

    features = np.random.default_rng(0).normal(size=(2, 4, 5))
    with pytest.raises(he.InputError, match=message):
        FeatureStatistics.fit(features, labels, 3)


@pytest.mark.parametrize(
    ("option", "value"), [("bank_size", 0), ("bank_size", -1), ("knn_k", 0), ("knn_k", 1.5)]
)
def test_feature_statistics_refuse_sizes_that_would_fail_at_scoring(option, value):
    from hydra_ensembles.ood import FeatureStatistics

    features = np.random.default_rng(0).normal(size=(2, 6, 5))
    with pytest.raises(he.InputError, match=f"{option} must be a positive whole number"):
        FeatureStatistics.fit(features, np.arange(6) % 3, 3, **{option: value})


def test_calibration_fit_refuses_a_level_outside_its_range_and_another_models_ood_predictions():
    from hydra_ensembles.calibration import Calibration

    val = _preds(members=2, n=40, classes=3)
    with pytest.raises(he.InputError, match=r"keep must be in \(0, 1\]"):
        Calibration.fit(val, score="msp", keep=1.5)
    other = _preds(members=2, n=30, classes=4, labels=False)  # another model's (4 classes)
    with pytest.raises(he.InputError, match="not of the model of the ID ones"):
        Calibration.fit(val, score="auto", keep=0.9, ood_validation=other)


def test_build_hydra_checks_its_batches_before_any_work():
    model = tiny_bert(layers=1, heads=2)
    inputs = text_inputs(batch=4, tokens=5)
    floats = {**labelled(inputs), "input_ids": inputs["input_ids"].float()}
    with pytest.raises(he.InputError, match="input_ids in train must be an integer tensor"):
        he.build_hydra(model, [floats], [labelled(inputs)], config=he.BuildConfig(num_pruned=1))
    narrow = {**inputs, "labels": torch.tensor([0, 1, 2, 0], dtype=torch.int8)}  # any integer width
    built = he.build_hydra(
        model, None, [narrow], config=he.BuildConfig(num_pruned=1, num_members=2), progress=False
    )
    assert built.calibration is not None


def test_a_row_with_nothing_to_read_is_refused_as_the_graph_refuses_it():
    """An attention mask of zeros only: the exported graph answers NaN for that row, so PyTorch's
    predict refuses it too, instead of answering a number the graph would not."""
    model = tiny_bert(layers=1, heads=2)
    inputs = text_inputs(batch=4, tokens=5)
    inputs["attention_mask"][2] = 0
    with pytest.raises(he.InputError, match=r"row 2 of .* attention mask of zeros only"):
        predict(model, [inputs], progress=False)


def test_logits_that_overflow_name_the_model_and_the_cause():
    model = tiny_bert(layers=1, heads=2)
    with torch.no_grad():
        model.classifier.weight.fill_(3e38)  # with the bias, past float32's largest (3.4e38)
        model.classifier.bias.fill_(3e38)
    message = r"BertForSequenceClassification's logits are not finite .* 3e\+38"
    with pytest.raises(he.InputError, match=message):
        predict(model, [text_inputs(batch=4, tokens=5)], progress=False)


def test_validation_data_of_one_class_fit_no_temperature():
    """With every input of one class the NLL falls without bound as the temperature runs off (a
    temperature of millions that turns every probability into 1/C): refused, naming the class."""
    from hydra_ensembles.calibration import Calibration, CalibrationConfig
    from hydra_ensembles.calibration.calibration import check_calibration_data

    one_class = Predictions(np.random.default_rng(0).normal(size=(2, 40, 3)), np.zeros(40, int))
    for fit in (lambda: fit_temperature(one_class), lambda: Calibration.fit(one_class)):
        with pytest.raises(ValueError, match="of one class"):
            fit()
    with pytest.raises(ValueError, match="of one class"):  # one input is one class too
        Calibration.fit(Predictions(np.zeros((2, 1, 3)), np.array([1])), set_method="")
    with pytest.raises(ValueError, match="at least 2 labelled validation inputs"):
        check_calibration_data(np.array([1]), CalibrationConfig(set_method="lac"))
    with pytest.raises(ValueError, match=r"of one class \(.sport.\)"):
        check_calibration_data(
            [{"labels": torch.ones(5, dtype=torch.long)}], CalibrationConfig(set_method=""), _named()
        )


def _named():
    model = tiny_bert(labels=2)
    model.config.id2label, model.config.label2id = {0: "money", 1: "sport"}, {"money": 0, "sport": 1}
    return model


def test_per_class_sets_need_every_class_among_the_inputs_that_fit_them():
    """A class absent from the odd inputs (those that fit the sets) would be in every set."""
    from hydra_ensembles.calibration import Calibration, CalibrationConfig
    from hydra_ensembles.calibration.calibration import check_calibration_data

    labels = np.array([1] + [0] * 19)  # 'sport' at an even position only
    config = CalibrationConfig(set_method="lac", set_classwise=True)
    with pytest.raises(ValueError, match="none of 'sport'"):
        check_calibration_data(labels, config, _named())
    with pytest.raises(ValueError, match="Mondrian"):
        Calibration.fit(Predictions(np.random.default_rng(0).normal(size=(1, 20, 2)), labels), config)
    check_calibration_data(np.array([0, 0, 1, 1] * 5), config, _named())  # every class in both halves
    check_calibration_data(labels, config.replace(set_classwise=False), _named())


def test_nan_logits_are_named_as_the_cause_not_as_a_temperature():
    logits = np.random.default_rng(0).normal(size=(2, 10, 3))
    logits[1, 4, 2] = np.nan
    for sets in ("", "lac"):  # named by its index among every validation input, with sets too
        with pytest.raises(ValueError, match=r"NaN or Inf on validation input 4 \(member 1\)"):
            he.calibration.Calibration.fit(Predictions(logits, np.arange(10) % 3), set_method=sets)


def test_features_too_wide_for_memory_are_refused_before_allocating(monkeypatch):
    from hydra_ensembles.ood import detectors

    monkeypatch.setattr(detectors, "_available_memory", lambda: 2**30)
    wide = np.zeros((1, 4, 30_000), np.float32)
    with pytest.raises(ValueError, match=r"30000 wide need 26\.8 GiB .* 1\.0 GiB are available"):
        detectors.FeatureStatistics.fit(wide, np.array([0, 1, 0, 1]), 2, scores=("mds",))
    detectors.check_fit_memory(30_000, available=2**40)  # enough memory: fit
