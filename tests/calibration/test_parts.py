"""A calibration's parts, each fit and saved on its own: the flag, the prediction sets and the
provenance read back equal from their JSON records and refused where damaged; the calibration's
record is one object per part."""

import json

import numpy as np
import pytest

from hydra_ensembles.calibration import (
    Calibration,
    CalibrationConfig,
    DataRecord,
    Flag,
    PredictionSets,
    Provenance,
)
from hydra_ensembles.calibration.settings import SET_METHODS
from hydra_ensembles.evaluation import Predictions, fit_temperature, ood_scores
from hydra_ensembles.evaluation.conformal import NONCONFORMITY_SCORES, set_scores
from hydra_ensembles.evaluation.temperature import split_for_sets


def _preds(n: int = 120, seed: int = 0) -> Predictions:
    rng = np.random.default_rng(seed)
    return Predictions(rng.normal(size=(3, n, 4)) * 3, rng.integers(0, 4, n))


def _json(record):
    return json.loads(json.dumps(record))


def test_each_part_is_fit_as_the_calibration_fits_it():
    preds = _preds()
    config = CalibrationConfig(score="entropy", keep=0.9, set_method="aps", set_alpha=0.2)
    calibration = Calibration.fit(preds, config)
    temperature_on, sets_on = split_for_sets(preds)
    temperature = float(fit_temperature(temperature_on))
    assert calibration.temperature == temperature
    scores = ood_scores(preds, "entropy", temperature)
    assert calibration.flag == Flag.fit("entropy", scores, config, None)
    assert calibration.sets == PredictionSets.fit(sets_on, temperature, config)
    assert calibration.sets.examples == 60 and calibration.config == config
    assert Calibration.fit(preds, config.replace(set_method="")).sets is None


def test_each_part_reads_back_equal_from_its_own_record():
    calibration = Calibration.fit(_preds(), score="msp", keep=0.9, set_method="lac", set_classwise=True)
    flag, sets = calibration.flag, calibration.sets
    assert Flag.from_dict(_json(flag.to_dict())) == flag
    assert PredictionSets.from_dict(_json(sets.to_dict())) == sets
    read = Provenance(DataRecord("v.csv", "a" * 64), DataRecord("t.csv", "b" * 64))
    assert Provenance.from_dict(_json(read.to_dict())) == read
    record = calibration.to_dict()
    assert set(record) == {"temperature", "flag", "sets", "provenance", "examples", "precision",
                           "model_sha256", "record_sha256"}  # fmt: skip
    assert record["flag"] == flag.to_dict() and record["sets"] == sets.to_dict()


SETS = {"method": "lac", "alpha": 0.1, "classwise": False, "quantiles": [0.5], "examples": 3}


@pytest.mark.parametrize(
    ("part", "record", "message"),
    [
        (Flag, {"score": "msp"}, "flag has the fields"),
        (Flag, [], "is a JSON object"),
        (PredictionSets, {**SETS, "quantiles": []}, "their quantiles"),
        (PredictionSets, {**SETS, "alpha": 1.5}, "set_alpha must be in"),
        (PredictionSets, {**SETS, "classwise": None, "extra": 1}, "prediction sets has the fields"),
        (Provenance, {"validation": {"name": "v", "sha256": ""}}, "names the data of"),
    ],
)
def test_a_damaged_part_is_refused_in_one_line(part, record, message):
    with pytest.raises(ValueError, match=message):
        part.from_dict(record)


def test_a_conformal_flag_holds_the_threshold_its_scores_give():
    flag = Calibration.fit(_preds(), score="msp", keep=0.9).flag
    with pytest.raises(ValueError, match="does not follow from its calibration scores"):
        Flag("msp", flag.threshold + 1.0, 0.9, "conformal", flag.calibration_scores)
    with pytest.raises(ValueError, match="needs feature statistics"):
        Flag("mds", 1.0, 0.9)
    with pytest.raises(ValueError, match="p-values need a conformal flag"):
        Flag("msp", 0.5, 0.9).p_values([0.1])


def test_every_set_method_a_calibration_names_is_one_the_conformal_scores_compute():
    assert set(SET_METHODS) == set(NONCONFORMITY_SCORES)
    probs = np.full((2, 3), 1 / 3)
    for method in SET_METHODS:
        assert set_scores(probs, method).shape == (2, 3)
    with pytest.raises(ValueError, match="unknown prediction-set method"):
        set_scores(probs, "naive")
