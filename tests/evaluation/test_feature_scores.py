"""Feature scores in the evaluation: the flag score's rule, the calibration's record of the
statistics, older saved calibrations, and every score in a method's results."""

import numpy as np
import pytest

from hydra_ensembles.calibration import Calibration
from hydra_ensembles.calibration.provenance import NO_DATA, DataRecord, Provenance
from hydra_ensembles.evaluation import (
    Predictions,
    choose_flag_score,
    evaluate_predictions,
    main_row,
    ood_scores,
)
from hydra_ensembles.evaluation.flag_score import validation_aurocs
from hydra_ensembles.ood import FeatureStatistics, feature_scores


def _preds(n, shift=0.0, seed=0, labelled=True, members=2):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    centres = np.eye(3, 6) * 4
    feats = centres[y][None] + rng.normal(size=(members, n, 6)) + shift
    logits = np.einsum("mnd,cd->mnc", feats, np.eye(3, 6)) + rng.normal(scale=0.1, size=(members, n, 3))
    return Predictions(logits, y if labelled else None, feats)


def test_the_rule_picks_the_best_validation_auroc_and_mds_without_ood_data():
    train, val = _preds(120, seed=1), _preds(90, seed=2)
    ood = _preds(60, shift=3.0, seed=3, labelled=False)  # far in feature space, logits alike
    stats = FeatureStatistics.fit(train.member_features, train.labels, 3)
    aurocs = validation_aurocs(val, ood, stats)
    assert set(aurocs) == {
        "msp",
        "max_logit",
        "energy",
        "entropy",
        "mutual_information",
        "gen",
        *stats.scores,
    }
    chosen = choose_flag_score(val, stats, ood)
    assert aurocs[chosen] == max(aurocs.values())
    assert chosen in feature_scores()  # the shift is in the features
    assert choose_flag_score(val, stats) == "mds"  # no OOD validation data: the default
    assert choose_flag_score(val) == "msp"  # no statistics: the logit default
    bare = Predictions(val.member_logits, val.labels)  # no features: logit scores only
    assert choose_flag_score(bare, stats, Predictions(ood.member_logits)) not in feature_scores()


def test_ood_validation_data_that_separates_nothing_chooses_nothing_and_says_so():
    """OOD validation data drawn like the ID validation data (here: the same inputs) gives every
    score an AUROC near 0.5: the rule without OOD data applies, with a warning naming the choice."""
    train, val = _preds(120, seed=1), _preds(90, seed=2)
    stats = FeatureStatistics.fit(train.member_features, train.labels, 3)
    alike = Predictions(val.member_logits, None, val.member_features)
    with pytest.warns(UserWarning, match=r"separates no score .* the flag score is mds, as without OOD data"):
        assert choose_flag_score(val, stats, alike) == "mds"
    with pytest.warns(UserWarning, match="the flag score is msp"):
        assert choose_flag_score(val, None, alike) == "msp"


def test_a_calibration_on_a_feature_score_records_its_statistics():
    train, val = _preds(120, seed=1), _preds(90, seed=2)
    stats = FeatureStatistics.fit(train.member_features, train.labels, 3)
    calibration = Calibration.fit(
        val, score="mds", keep=0.9, statistics=stats, provenance=Provenance(NO_DATA, DataRecord("train.csv"))
    )
    assert calibration.flag.statistics_sha256 == stats.digest() and calibration.flag.score == "mds"
    share = np.mean(ood_scores(val, "mds", statistics=stats) <= calibration.flag.threshold)
    assert share == pytest.approx(0.9, abs=0.02)
    saved = calibration.to_dict()
    assert "statistics" not in saved and saved["provenance"]["statistics"]["name"] == "train.csv"
    again = Calibration.from_dict(saved)
    assert again == calibration and again.flag.statistics is None  # the statistics are saved beside it
    records = calibration.records(_preds(5, seed=4))
    assert {"ood_score_mds", "ood_score_mds_spread", "flagged"} <= set(records[0])
    with pytest.raises(ValueError, match="reads feature statistics"):
        Calibration.fit(val, score="knn", keep=0.9)
    older = {  # the flat record saved before feature scores, conformal flags and checksums existed
        "temperature": 1.3, "score": "msp", "threshold": 0.4, "keep": 0.95, "data": "v.csv",
        "data_sha256": "", "examples": 90, "precision": "fp32", "model_sha256": "",
    }  # fmt: skip
    loaded = Calibration.from_dict(older)
    assert (loaded.flag.score, loaded.flag.method, loaded.sets, loaded.provenance.validation.name) == (
        "msp", "quantile", None, "v.csv",
    )  # fmt: skip
    with pytest.raises(ValueError, match="has the fields"):
        Calibration.from_dict({**older, "unknown": 1})


def test_every_score_is_evaluated_with_the_members_spread():
    train, test = _preds(120, seed=1), _preds(90, seed=2)
    stats = FeatureStatistics.fit(train.member_features, train.labels, 3)
    ood = {"shifted": ("near", _preds(60, shift=3.0, seed=3, labelled=False))}
    result = evaluate_predictions(test, ood, statistics=stats)
    assert set(result["ood_summary"]) == {
        "msp",
        "max_logit",
        "energy",
        "entropy",
        "mutual_information",
        "gen",
        *stats.scores,
    }
    assert len(result["ood"]["shifted"]["member_auroc"]["mds"]) == 2
    row = main_row({**result, "flag_score": "mds"})
    assert row["auroc"] == row["auroc@mds"] == result["ood_summary"]["mds"]["average"]["auroc"]
    assert main_row(result)["auroc"] == result["ood_summary"]["msp"]["average"]["auroc"]
    no_features = evaluate_predictions(Predictions(test.member_logits, test.labels), ood, statistics=stats)
    assert not set(no_features["ood_summary"]) & set(feature_scores())
