"""Per-example uncertainty records and the ID-validation flag threshold, against hand computation."""

import numpy as np
import pytest

from hydra_ensembles.evaluation import Predictions, flag_threshold, per_example


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _entropy(p):
    return -(p * np.log(p)).sum(-1)


def test_records_match_hand_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 4)) * 2
    labels = np.array([0, 1, 2, 3, 0])
    preds = Predictions(logits, labels)
    records = per_example(preds, ["a", "b", "c", "d"], temperature=1.5, threshold=0.3)
    member = _softmax(logits / 1.5)
    mean = member.mean(0)
    for i, r in enumerate(records):
        top = mean[i].argmax()
        assert r["predicted"] == "abcd"[top] and r["confidence"] == pytest.approx(mean[i, top])
        assert [r[f"p_{c}"] for c in "abcd"] == pytest.approx(mean[i])
        assert r["entropy"] == pytest.approx(_entropy(mean[i]))
        assert r["mutual_information"] == pytest.approx(_entropy(mean[i]) - _entropy(member[:, i]).mean())
        assert r["members_agreeing"] == pytest.approx((member[:, i].argmax(-1) == top).mean())
        assert r["ood_score_msp"] == pytest.approx(1 - mean[i, top])  # higher = more likely OOD
        assert r["flagged"] == (1 - mean[i, top] > 0.3)
        assert r["label"] == "abcd"[labels[i]] and r["correct"] == (top == labels[i])


def test_single_model_has_no_mutual_information_and_unlabelled_has_no_label():
    records = per_example(Predictions(np.random.default_rng(1).normal(size=(1, 6, 3))), flag_score="entropy")
    assert not any("mutual_information" in r or "members_agreeing" in r for r in records)
    assert {"p_0", "p_1", "p_2", "entropy"} <= set(records[0]) and "label" not in records[0]
    assert "flagged" not in records[0]


def test_flag_threshold_keeps_the_chosen_share_of_validation_inputs():
    val = Predictions(np.random.default_rng(2).normal(size=(2, 400, 5)) * 3)
    threshold = flag_threshold(val, "msp", keep=0.9)
    flagged = np.mean([r["flagged"] for r in per_example(val, threshold=threshold)])
    assert flagged == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match="keep must be"):
        flag_threshold(val, keep=1.5)
    with pytest.raises(ValueError, match="unknown OOD score"):
        flag_threshold(val, "nope")
    with pytest.raises(ValueError, match="2 class names for a model with 5 classes"):
        per_example(val, ["x", "y"])
