"""The conformal flag keeps its promise: on exchangeable ID data its false-flag rate is at most
alpha, exactly floor((n+1) alpha)/(n+1) in expectation, checked by simulation against that
formula; the p-value and the threshold flag the same inputs; the plain quantile does not keep
the promise for small n."""

import math

import numpy as np
import pytest

from hydra_ensembles.evaluation.conformal import conformal_p_values, conformal_threshold, smallest_alpha


@pytest.mark.parametrize(("n", "alpha"), [(19, 0.05), (49, 0.1), (30, 0.1), (200, 0.05)])
def test_the_false_flag_rate_is_at_most_alpha(n, alpha):
    """Many calibration sets of n ID scores, each with fresh ID inputs: the share flagged averages
    floor((n+1) alpha)/(n+1) <= alpha, within the simulation's standard error."""
    rng = np.random.default_rng(n)
    trials, fresh = 4000, 50
    calibration = rng.standard_normal((trials, n))
    new = rng.standard_normal((trials, fresh))
    thresholds = np.array([conformal_threshold(c, alpha) for c in calibration])
    rate = float((new > thresholds[:, None]).mean())
    expected = math.floor((n + 1) * alpha) / (n + 1)
    # thresholds vary per trial; fresh inputs within a trial are correlated through it
    error = np.sqrt(expected * (1 - expected) / trials) * 3
    assert rate == pytest.approx(expected, abs=4 * error) and expected <= alpha
    # the plain quantile of the same scores flags more than alpha where n is small
    plain = np.array([np.quantile(c, 1 - alpha) for c in calibration])
    if n < 50:
        assert float((new > plain[:, None]).mean()) > alpha


def test_p_values_flag_exactly_what_the_threshold_flags():
    rng = np.random.default_rng(1)
    calibration = rng.standard_normal(99)
    scores = np.concatenate([rng.standard_normal(500) * 1.5, calibration[:10]])  # ties included
    for alpha in (0.01, 0.05, 0.1, 0.37):
        threshold = conformal_threshold(calibration, alpha)
        p = conformal_p_values(calibration, scores)
        assert ((p <= alpha) == (scores > threshold)).all()
    assert conformal_p_values(calibration, [np.inf])[0] == pytest.approx(1 / 100)
    assert conformal_p_values(calibration, [-np.inf])[0] == 1.0


def test_too_few_scores_for_the_level_are_refused():
    assert smallest_alpha(19) == pytest.approx(0.05)
    conformal_threshold(np.arange(19.0), 0.05)  # the smallest n for alpha 0.05
    with pytest.raises(ValueError, match=r"cannot flag at level 0\.05"):
        conformal_threshold(np.arange(18.0), 0.05)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        conformal_threshold(np.arange(18.0), 0.0)
