"""The conformal flag keeps its promise: on exchangeable ID data its false-flag rate is at most
alpha, exactly floor((n+1) alpha)/(n+1) in expectation, checked by simulation against that
formula; the p-value and the threshold flag the same inputs; the plain quantile does not keep
the promise for small n. On a real model's probabilities (logistic regression on scikit-learn's
digits), the covered counts of 1,000 random splits follow their exact finite-sample law for LAC,
APS, RAPS and, per class, Mondrian sets (the uncorrected quantile fails most of them)."""

import functools
import math

import numpy as np
import pytest

from hydra_ensembles.evaluation.conformal import (
    benjamini_hochberg,
    conformal_p_values,
    conformal_threshold,
    flag_count,
    flags,
    one_draw_range,
    smallest_alpha,
)


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


@pytest.mark.parametrize("n", [19, 41, 42, 99])
def test_the_flag_and_the_p_value_agree_at_every_grid_point(n):
    """At levels on or within rounding of a p-value grid point j / (n + 1) (as ``1 - keep`` gives
    them), the threshold flags exactly the inputs whose reported p-value is <= the level: the
    decision is on counts, with no rounding guard to disagree with the p-value."""
    rng = np.random.default_rng(n)
    calibration = rng.standard_normal(n)
    scores = np.concatenate([rng.standard_normal(300), calibration])  # every grid point reached
    p = conformal_p_values(calibration, scores)
    for j in range(1, n + 1):
        for keep in (1 - j / (n + 1), np.nextafter(1 - j / (n + 1), 0), np.nextafter(1 - j / (n + 1), 1)):
            alpha = 1 - keep
            if alpha < smallest_alpha(n) or alpha >= 1:
                continue
            if flag_count(n, alpha) == 0:
                continue
            threshold = conformal_threshold(calibration, alpha)
            assert (flags(scores, threshold) == (p <= alpha)).all(), (j, keep)
    keep = 0.9534883720930333  # within 1e-12 of the grid point 2/43 with 42 inputs
    if n == 42:
        assert (flags(scores, conformal_threshold(calibration, 1 - keep)) == (p <= 1 - keep)).all()


def test_a_score_that_is_not_a_number_is_flagged_with_the_smallest_p_value():
    calibration = np.arange(20.0)
    threshold = conformal_threshold(calibration, 0.05)
    scores = np.array([np.nan, 0.0, 100.0, -np.inf])
    assert flags(scores, threshold).tolist() == [True, False, True, False]
    p = conformal_p_values(calibration, scores)
    assert p[0] == pytest.approx(1 / 21) and p[0] <= 0.05
    assert ((p <= 0.05) == flags(scores, threshold)).all()


def test_too_few_scores_for_the_level_are_refused():
    assert smallest_alpha(19) == pytest.approx(0.05)
    conformal_threshold(np.arange(19.0), 0.05)  # the smallest n for alpha 0.05
    with pytest.raises(ValueError, match=r"cannot flag at level 0\.05"):
        conformal_threshold(np.arange(18.0), 0.05)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        conformal_threshold(np.arange(18.0), 0.0)


def _draw(rng, n, classes=5, sharp=2.0):
    """Inputs whose labels follow a known distribution, and a model's (imperfect) probabilities."""
    logits = rng.normal(size=(n, classes)) * sharp
    truth = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = np.array([rng.choice(classes, p=t) for t in truth])
    model = np.exp(logits * 0.6) / np.exp(logits * 0.6).sum(1, keepdims=True)  # under-confident
    return model, labels


@pytest.mark.parametrize(
    ("method", "options", "exact"),
    [
        ("lac", {}, True),
        ("aps", {"randomized": True}, True),
        ("aps", {}, False),
        ("raps", {"penalty": 0.05, "k_reg": 1}, False),
    ],
)
def test_prediction_sets_cover_the_true_class_with_probability_at_least_1_minus_alpha(method, options, exact):
    """Split conformal: over many calibration/test draws the sets hold the true class at least
    1 - alpha of the time (at most 1 - alpha + 1/(n+1) for continuous scores)."""
    from hydra_ensembles.evaluation.conformal import fit_set_quantiles, prediction_sets

    rng = np.random.default_rng(3)
    n, alpha, coverage = 99, 0.1, []
    for _ in range(300):
        cal_p, cal_y = _draw(rng, n)
        test_p, test_y = _draw(rng, 100)
        extra = {}
        if options.get("randomized"):
            extra = {"uniform": rng.random(n)}
        quantiles = fit_set_quantiles(cal_p, cal_y, alpha, method, **options, **extra)
        if options.get("randomized"):
            extra = {"uniform": rng.random(100)}
        sets = prediction_sets(test_p, quantiles, method, **options, **extra)
        coverage.append(sets[np.arange(100), test_y].mean())
    mean, error = float(np.mean(coverage)), 3 * float(np.std(coverage)) / np.sqrt(len(coverage))
    assert mean >= 1 - alpha - error
    if exact:
        assert mean <= 1 - alpha + 1 / (n + 1) + error


def test_mondrian_sets_cover_every_class():
    from hydra_ensembles.evaluation.conformal import fit_set_quantiles, prediction_sets

    rng = np.random.default_rng(4)
    alpha, hits = 0.1, {c: [] for c in range(5)}
    for _ in range(200):
        cal_p, cal_y = _draw(rng, 400)
        test_p, test_y = _draw(rng, 200)
        sets = prediction_sets(test_p, fit_set_quantiles(cal_p, cal_y, alpha, "lac", classwise=True), "lac")
        for c in range(5):
            hits[c].extend(sets[test_y == c, c].tolist())
    for c in range(5):
        assert np.mean(hits[c]) >= 1 - alpha - 3 * np.sqrt(alpha * (1 - alpha) / len(hits[c]))


def test_set_scores_against_their_definitions():
    from hydra_ensembles.evaluation.conformal import set_scores

    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    assert np.allclose(set_scores(p, "lac"), 1 - p)
    assert np.allclose(set_scores(p, "aps"), [[0.5, 0.8, 1.0], [1.0, 0.6, 0.9]])
    raps = set_scores(p, "raps", penalty=0.1, k_reg=1)
    assert np.allclose(raps, [[0.5, 0.9, 1.2], [1.2, 0.6, 1.0]])
    randomized = set_scores(p, "aps", randomized=True, uniform=[0.5, 0.0])
    assert np.allclose(randomized, [[0.25, 0.65, 0.9], [0.9, 0.0, 0.6]])


def test_a_calibration_with_prediction_sets_keeps_the_temperature_and_the_sets_apart():
    """The even validation inputs fit the temperature, the odd ones the sets' quantile at it; the
    records name each input's set; the saved record round-trips."""
    import json

    from hydra_ensembles.calibration import Calibration
    from hydra_ensembles.evaluation import Predictions, fit_temperature
    from hydra_ensembles.evaluation.conformal import fit_set_quantiles

    rng = np.random.default_rng(5)
    probs, labels = _draw(rng, 200, classes=4)
    preds = Predictions(np.log(probs)[None] * 2.0, labels)
    calibration = Calibration.fit(preds, score="msp", keep=0.9, set_method="aps", set_alpha=0.2)
    even = Predictions(preds.member_logits[:, 0::2], labels[0::2])
    assert calibration.temperature == pytest.approx(fit_temperature(even), rel=1e-12)
    odd_probs = Predictions(preds.member_logits[:, 1::2], labels[1::2]).probs(calibration.temperature)
    expected = fit_set_quantiles(odd_probs, labels[1::2], 0.2, "aps")
    assert calibration.sets.quantiles == pytest.approx(tuple(expected)) and calibration.sets.examples == 100
    records = calibration.records(preds, ["a", "b", "c", "d"])
    assert all(len(r["prediction_set"]) == r["set_size"] for r in records)
    members = calibration.prediction_sets(preds)
    assert [r["prediction_set"] for r in records] == [
        [n for n, m in zip("abcd", row, strict=True) if m] for row in members
    ]
    again = Calibration.from_dict(json.loads(json.dumps(calibration.to_dict())))
    assert again == calibration and again.records(preds, ["a", "b", "c", "d"]) == records
    few = Calibration.fit(
        Predictions(preds.member_logits[:, :10], labels[:10]), score="msp", keep=0.5, set_method="lac"
    )
    assert few.sets.quantiles == (np.inf,) * 4  # 5 inputs cannot set a 0.1-level quantile: every class


def test_the_coverage_of_a_calibration_draw_follows_its_beta_law():
    """With continuous scores the coverage a calibration set gives is Beta(n+1-l, l) distributed,
    l = floor((n+1) alpha) (Vovk, 2012): scores uniform on [0, 1], so the coverage of a quantile q
    is q itself; 2,000 calibration draws against that law (KS test, p > 0.001)."""
    from scipy import stats

    from hydra_ensembles.evaluation.conformal import set_quantile

    rng = np.random.default_rng(7)
    n, alpha = 99, 0.1
    coverage = np.array([set_quantile(rng.random(n), alpha) for _ in range(2000)])
    low = math.floor((n + 1) * alpha)
    assert stats.kstest(coverage, stats.beta(n + 1 - low, low).cdf).pvalue > 1e-3
    error = 3 * coverage.std() / np.sqrt(len(coverage))  # the band holds for the expectation
    assert 1 - alpha - error <= coverage.mean() <= 1 - alpha + 1 / (n + 1) + error
    wrong = np.array([np.quantile(rng.random(n), 1 - alpha) for _ in range(2000)])  # no (n+1)
    assert stats.kstest(wrong, stats.beta(n + 1 - low, low).cdf).pvalue < 1e-3


def test_id_p_values_are_uniform():
    """For exchangeable ID inputs, p-values take the values k/(n+1) with equal chance."""
    rng = np.random.default_rng(8)
    n = 49
    p = np.concatenate([conformal_p_values(rng.normal(size=n), rng.normal(size=20)) for _ in range(1000)])
    counts = np.bincount(np.rint(p * (n + 1)).astype(int) - 1, minlength=n + 1)
    expected = len(p) / (n + 1)
    assert (np.abs(counts - expected) < 5 * np.sqrt(expected)).all()
    for alpha in (0.02, 0.05, 0.1, 0.2):
        assert np.mean(p <= alpha) <= alpha + 3 * np.sqrt(alpha / len(p))


@functools.cache  # seconds of fitting, shared by the tests that read it (read-only)
def _digits_probabilities():
    """A real model's held-out probabilities: logistic regression on scikit-learn's digits (1,797
    8x8 images, 10 classes), each image predicted by the fold that did not train on it."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_predict

    x, y = load_digits(return_X_y=True)
    model = LogisticRegression(C=0.01, max_iter=300)  # weak enough to leave real uncertainty
    probs = cross_val_predict(model, x / 16.0, y, cv=5, method="predict_proba")
    probs.setflags(write=False)
    y.setflags(write=False)
    return probs, y


def _law_fits(covered: np.ndarray, m: int, k: int, n: int) -> float:
    """Chi-square p-value of covered-test-point counts against their exact law for exchangeable
    continuous scores: BetaBinomial(m, k, n + 1 - k) (k = ceil((n + 1)(1 - alpha))), bins merged
    until each expects at least 5 draws."""
    from scipy import stats

    pmf = stats.betabinom(m, k, n + 1 - k).pmf(np.arange(m + 1))
    observed = np.bincount(covered, minlength=m + 1).astype(float)
    expected = pmf * len(covered)
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    bins_o[-1], bins_e[-1] = bins_o[-1] + acc_o, bins_e[-1] + acc_e
    return float(stats.chisquare(bins_o, np.array(bins_e) * sum(bins_o) / sum(bins_e)).pvalue)


@pytest.mark.parametrize(
    ("method", "options"),
    [("lac", {}), ("aps", {"randomized": True}), ("aps", {}), ("raps", {"penalty": 0.05, "k_reg": 2})],
)
def test_on_a_real_models_scores_coverage_follows_its_exact_law(method, options):
    """1,000 random calibration/test splits of a real model's probabilities (n = 199 calibration,
    m = 200 test inputs each): the number of covered test inputs follows its exact finite-sample
    law (chi-square p > 0.001) and its mean lies in [1 - alpha, 1 - alpha + 1/(n + 1)]."""
    from hydra_ensembles.evaluation.conformal import fit_set_quantiles, prediction_sets

    probs, labels = _digits_probabilities()
    rng = np.random.default_rng(11)
    n, m, alpha = 199, 200, 0.1
    covered = []
    for _ in range(1000):
        order = rng.permutation(len(labels))
        cal, test = order[:n], order[n : n + m]
        u = {"uniform": rng.random(len(labels))} if options.get("randomized") else {}
        cal_u = {"uniform": u["uniform"][cal]} if u else {}
        test_u = {"uniform": u["uniform"][test]} if u else {}
        quantiles = fit_set_quantiles(probs[cal], labels[cal], alpha, method, **options, **cal_u)
        sets = prediction_sets(probs[test], quantiles, method, **options, **test_u)
        covered.append(int(sets[np.arange(m), labels[test]].sum()))
    covered = np.array(covered)
    k = math.ceil((n + 1) * (1 - alpha))
    assert _law_fits(covered, m, k, n) > 1e-3
    error = 3 * covered.std() / m / np.sqrt(len(covered))
    assert 1 - alpha - error <= covered.mean() / m <= 1 - alpha + 1 / (n + 1) + error


def test_on_a_real_models_scores_mondrian_coverage_follows_its_law_in_every_class():
    """The same splits, class-conditional (LAC) sets: within each class the covered count follows
    the law of that class's own calibration size."""
    from scipy import stats

    from hydra_ensembles.evaluation.conformal import fit_set_quantiles, prediction_sets

    probs, labels = _digits_probabilities()
    rng = np.random.default_rng(12)
    alpha, per_class = 0.1, 49
    counts: dict[int, list[int]] = {c: [] for c in range(10)}
    for _ in range(400):
        cal, test = [], []
        for c in range(10):  # n = 49 calibration and 60 test inputs of every class
            members = rng.permutation(np.flatnonzero(labels == c))
            cal.extend(members[:per_class])
            test.extend(members[per_class : per_class + 60])
        cal, test = np.array(cal), np.array(test)
        quantiles = fit_set_quantiles(probs[cal], labels[cal], alpha, "lac", classwise=True)
        sets = prediction_sets(probs[test], quantiles, "lac")
        for c in range(10):
            counts[c].append(int(sets[np.flatnonzero(labels[test] == c), c].sum()))
    k = math.ceil((per_class + 1) * (1 - alpha))
    pooled = [_law_fits(np.array(v), 60, k, per_class) for v in counts.values()]
    assert stats.combine_pvalues(pooled).pvalue > 1e-3 and min(pooled) > 1e-4


def test_evaluation_reports_sets_for_scaled_rows_and_the_flags_id_false_alarm_rate():
    """evaluate_method: the + TS row's sets are fit at a temperature from the even validation
    inputs and quantiles from the odd ones; each row's ID false-flag rate is its conformal flag
    (threshold on the validation scores) applied to the ID test, written out here."""
    from hydra_ensembles.calibration.calibration import split_for_sets
    from hydra_ensembles.evaluation import Predictions
    from hydra_ensembles.evaluation.conformal import fit_set_quantiles, prediction_sets
    from hydra_ensembles.evaluation.evaluate import ood_scores
    from hydra_ensembles.evaluation.run import MethodPredictions, evaluate_method
    from hydra_ensembles.evaluation.temperature import fit_temperature

    rng = np.random.default_rng(5)

    def preds(n):
        labels = rng.integers(0, 4, n)
        logits = rng.normal(size=(2, n, 4)) + 2.5 * np.eye(4)[labels][None]
        return Predictions(logits * 2, labels)

    val, test = preds(120), preds(300)
    rows = evaluate_method("m", MethodPredictions(test=test, ood={}, shift={}, val=val))[0]
    temperature_on, sets_on = split_for_sets(val)
    t = float(fit_temperature(temperature_on))
    quantiles = fit_set_quantiles(sets_on.probs(t), sets_on.labels, 0.1, "lac")
    members = prediction_sets(test.probs(t), quantiles, "lac")
    expected = members[np.arange(300), test.labels].mean()
    assert rows["m + TS"]["conformal_sets"]["0.1"]["lac"]["coverage"] == pytest.approx(expected)
    flag = rows["m"]["flag_rate"]
    threshold = conformal_threshold(ood_scores(val, rows["m"]["flag_score"], 1.0), 0.05)
    assert flag["id_test_rate"] == pytest.approx(
        np.mean(ood_scores(test, rows["m"]["flag_score"], 1.0) > threshold)
    )
    assert flag["alpha"] == 0.05 and flag["id_test_inputs"] == 300


@pytest.mark.parametrize(("ood_share", "level"), [(0.2, 0.1), (0.0, 0.1), (0.5, 0.2)])
def test_benjamini_hochberg_on_conformal_p_values_controls_the_false_discovery_rate(ood_share, level):
    """Many simulated batches, each with its own calibration set: the share of ID inputs among
    those selected averages at most level x (share of ID inputs), within the simulation's error,
    and the selection finds OOD inputs where there are any; the per-input flag at the same level
    does not bound that share where OOD inputs are few."""
    rng = np.random.default_rng(int(100 * ood_share + 10 * level))
    trials, n, m = 3000, 99, 40
    outliers = int(ood_share * m)
    false_shares, found, naive = [], [], []
    for _ in range(trials):
        calibration = rng.standard_normal(n)
        batch = np.concatenate([rng.standard_normal(m - outliers), rng.normal(3.0, 1.0, outliers)])
        p = conformal_p_values(calibration, batch)
        selected = benjamini_hochberg(p, level)
        is_id = np.arange(m) < m - outliers
        false_shares.append((selected & is_id).sum() / max(1, selected.sum()))
        found.append((selected & ~is_id).sum() / max(1, outliers))
        flagged = p <= level
        naive.append((flagged & is_id).sum() / max(1, flagged.sum()))
    bound = level * (m - outliers) / m
    error = np.std(false_shares) / np.sqrt(trials)
    assert np.mean(false_shares) <= bound + 3 * error
    if outliers:
        assert np.mean(found) > 0.5
    if ood_share == 0.0:
        assert np.mean(naive) > 2 * level  # the per-input flag's false alarms are all its flags


def test_benjamini_hochberg_selects_the_step_up_set_and_refuses_what_is_no_p_value():
    p = np.array([0.01, 0.04, 0.03, 0.2, 0.05, 0.9])
    # ranks 1..6 at level 0.3: thresholds 0.05, 0.1, 0.15, 0.2, 0.25, 0.3; the largest rank
    # passing is 5 (0.2 <= 0.25): every p-value up to 0.2 is selected
    assert benjamini_hochberg(p, 0.3).tolist() == [True, True, True, True, True, False]
    assert not benjamini_hochberg(np.array([0.5, 0.6]), 0.1).any()
    with pytest.raises(ValueError, match=r"false discovery rate must be in \(0, 1\)"):
        benjamini_hochberg(p, 1.0)
    with pytest.raises(ValueError, match="p-values in"):
        benjamini_hochberg([np.nan, 0.1], 0.1)


@pytest.mark.parametrize(("n", "alpha"), [(19, 0.05), (75, 0.1), (150, 0.05), (1000, 0.05), (500, 0.1)])
def test_one_draws_range_is_the_beta_law_of_the_conditional_rate(n, alpha):
    """The mean and 95% quantile `one_draw_range` gives (what build and eval print beside the
    level) are those of Beta(l, n + 1 - l), l = floor((n + 1) alpha), as scipy computes them."""
    from scipy.stats import beta

    mean, ceiling = one_draw_range(n, alpha)
    flagged = math.floor((n + 1) * alpha)
    law = beta(flagged, n + 1 - flagged)
    assert mean == pytest.approx(law.mean()) and ceiling == pytest.approx(law.ppf(0.95), rel=1e-9)
    assert one_draw_range(10, 0.05) == (0.0, 0.0)  # too few inputs to flag anything


def test_a_calibrations_description_gives_the_spread_of_one_draw():
    from hydra_ensembles.calibration import Calibration
    from hydra_ensembles.evaluation import Predictions

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 300, 3)) * 3
    labels = logits[0].argmax(-1)
    labels[::7] = (labels[::7] + 1) % 3
    said = Calibration.fit(Predictions(logits, labels), score="msp", keep=0.95, set_method="lac").describe()
    assert "under 7.2% for 95% of draws of 300 validation inputs" in said
    sets = "sets: lac, coverage at least 90% in expectation, above 85.8% for 95% of draws of 150 inputs"
    assert sets in said


def test_a_calibration_saved_with_the_rounded_rule_loads_and_flags_by_its_p_values():
    """Earlier versions set k = ceil((n + 1) keep - 1e-12), which moved a level within 1e-12 of a
    grid point onto it; such a saved record still loads (with a warning) and then flags exactly
    where its p-values are <= the level."""
    from hydra_ensembles.calibration import Calibration
    from hydra_ensembles.evaluation import Predictions

    rng = np.random.default_rng(3)
    logits = rng.normal(size=(1, 42, 3))
    labels = logits[0].argmax(-1)
    keep = 0.9534883720930333  # 1 - keep sits 1.3e-14 below 2/43
    fitted = Calibration.fit(Predictions(logits, labels), score="msp", keep=keep)
    scores = fitted.flag.calibration_scores
    legacy = scores[math.ceil(43 * keep - 1e-12) - 1]
    assert legacy != fitted.flag.threshold  # the two rules differ at this level
    saved = fitted.to_dict()
    saved["flag"]["threshold"] = legacy
    saved.pop("record_sha256")
    with pytest.warns(UserWarning, match="grid point"):
        again = Calibration.from_dict(saved)
    assert again.flag.threshold == fitted.flag.threshold
    probe = np.concatenate([np.asarray(scores), rng.uniform(0, 1, 50)])
    assert (flags(probe, again.flag.threshold) == (again.flag.p_values(probe) <= 1 - keep)).all()
