"""Do a saved model's conformal sets and flag keep their levels on your data? Re-split and see.

A saved model's calibration was fit on one draw of validation data; the coverage of its sets and
the share of ID inputs its flag raises, measured on one test split, land above or below their
levels by chance. This script predicts a labelled pool of ID inputs once, exactly as
``hydra-ens predict`` serves them (the saved precision and length), then draws ``--splits``
random re-splits of the pool into a calibration part (as many inputs as the saved calibration
was fit on, unless ``--calibration-size``) and a test part, fits the calibration on each
calibration part with the saved settings (score, level, flag method, set method; the saved
feature statistics, fit on training data outside the pool), and measures each test part.

Over re-splits of one pool the calibration and test parts are exchangeable, so the mean coverage
is at least 1 - alpha and the mean share flagged at most alpha whatever the model; a mean
outside that (beyond the simulation's error) is a defect, not chance. The spread is compared
with the exact finite-sample law of one draw (Beta-binomial: Vovk, 2012), which also says how
far a single split may land from the level.

    python benchmarks/conformal_resplits.py MODEL --data POOL.csv [--splits 500] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from scipy.stats import betabinom

from hydra_ensembles.calibration import Calibration, saved_calibration
from hydra_ensembles.data import load_spec, to_batches
from hydra_ensembles.data.labels import align_labels, model_class_names, num_model_labels
from hydra_ensembles.data.registry import saved_length
from hydra_ensembles.evaluation import Predictions, ood_scores, predict
from hydra_ensembles.evaluation.conformal import flags
from hydra_ensembles.loading import load_any, load_preprocessor


def _part(predictions: Predictions, rows: np.ndarray) -> Predictions:
    features = predictions.member_features
    return Predictions(
        predictions.member_logits[:, rows],
        predictions.labels[rows],
        None if features is None else features[:, rows],
    )


def _law(counts: np.ndarray, m: int, a: float, b: float) -> dict[str, float]:
    """Where the measured counts (out of m) fall against the Beta-binomial(m, a, b) law."""
    law = betabinom(m, a, b)
    return {
        "mean": float(counts.mean() / m),
        "mean_standard_error": float(counts.std(ddof=1) / m / math.sqrt(len(counts))),
        "law_mean": float(law.mean() / m),
        "quantiles_5_50_95": [float(q / m) for q in np.quantile(counts, [0.05, 0.5, 0.95])],
        "law_quantiles_5_50_95": [float(law.ppf(q) / m) for q in (0.05, 0.5, 0.95)],
        "sd": float(counts.std(ddof=1) / m),
        "law_sd": float(law.std() / m),
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("model", help="a saved model and its calibration (build's hydra/, finetune's output)")
    parser.add_argument("--data", required=True, help="labelled ID inputs the model never trained on")
    parser.add_argument("--calibration-size", type=int, help="default: the saved calibration's")
    parser.add_argument("--splits", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    model = load_any(args.model)
    saved = saved_calibration(model)
    if saved is None or saved.sets is None or saved.flag.method != "conformal":
        raise SystemExit(f"{args.model} has no saved calibration with conformal sets and flag")
    dataset = load_spec(args.data)
    dataset = align_labels(dataset, model_class_names(model), num_model_labels(model), args.data)
    tokenizer = load_preprocessor(args.model)
    batches = list(to_batches(dataset, tokenizer, args.batch_size, saved_length(model) or 128))
    pool = predict(model, batches, "the pool", precision=saved.precision)
    n = args.calibration_size or saved.examples
    m = len(pool.labels) - n
    if m < 1:
        raise SystemExit(f"the pool holds {len(pool.labels)} inputs: fewer than {n} + 1")
    rng = np.random.default_rng(args.seed)
    covered, flagged, sizes, empty = [], [], [], []
    for _ in range(args.splits):
        order = rng.permutation(len(pool.labels))
        calibration_part, test = _part(pool, order[:n]), _part(pool, order[n:])
        fitted = Calibration.fit(
            calibration_part, saved.config.replace(flag_method="conformal"), statistics=saved.flag.statistics,
            statistics_data=saved.provenance.statistics,
        )  # fmt: skip
        sets = fitted.prediction_sets(test)
        covered.append(int(sets[np.arange(m), test.class_labels()].sum()))
        scores = ood_scores(test, fitted.flag.score, fitted.temperature, fitted.flag.statistics)
        flagged.append(int(flags(scores, fitted.flag.threshold).sum()))
        sizes.append(float(sets.sum(1).mean()))
        empty.append(float((sets.sum(1) == 0).mean()))
    n_sets = len(range(1, n, 2))  # the odd positions of the calibration part fit the sets
    l_sets = math.floor((n_sets + 1) * saved.sets.alpha)
    l_flag = math.floor((n + 1) * (1 - saved.flag.keep))
    result = {
        "model": args.model,
        "data": args.data,
        "pool": len(pool.labels),
        "calibration_inputs": n,
        "test_inputs": m,
        "splits": args.splits,
        "precision": saved.precision,
        "flag_score": saved.flag.score,
        "set_method": saved.sets.method,
        "coverage": {
            "level": 1 - saved.sets.alpha,
            **_law(np.array(covered), m, n_sets + 1 - l_sets, l_sets),
        },
        "id_flag_rate": {"level": 1 - saved.flag.keep, **_law(np.array(flagged), m, l_flag, n + 1 - l_flag)},
        "mean_set_size": float(np.mean(sizes)),
        "empty_sets": float(np.mean(empty)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
