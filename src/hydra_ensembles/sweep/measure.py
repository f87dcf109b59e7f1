"""What a sweep measures of one saved candidate on the held-out halves, and each candidate's
paired bootstrap difference from the single model.

Beside its row of measures, each candidate keeps its per-input values on the held-out data
(``held.safetensors``: the served NLL of each ID input, and the flag score of each ID and OOD
input), so that the differences from the single model are paired on the same inputs and the
same resamples (`metrics.resample_indices`), whichever run measured which candidate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from ..calibration import saved_calibration
from ..evaluation import EvalData, evaluate_method, main_row, predict, predict_method
from ..evaluation.evaluate import member_feature_scores, ood_scores
from ..loading import load_any
from ..metrics import auroc, paired_difference, resample_indices, resampled_mean, resampled_ood
from ..ood.registry import feature_scores
from ..saving.files import atomic_write

HELD = "held.safetensors"
OOD_SET = "OOD validation (held out)"
RESAMPLES = 1000
"""Paired bootstrap resamples of the differences from the single model."""


def measure_saved(
    name: str, settings: dict[str, Any], folder: Path, data: Any, precision: str
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The saved model's measures on the held-out halves of ``data`` (a `SweepData`), as it is
    served (its saved temperature, flag score, statistics and threshold), its NLL and ECE at
    temperature 1, and its members' diversity; and its per-input values (`write_held`). Every
    layer's tokens are recorded where the model can, so that `mds_layers` is measured for every
    candidate, chosen or not."""
    model = load_any(str(folder))
    ood = {OOD_SET: ("far", data.ood_held)} if data.ood_held else {}
    preds = predict_method(
        model,
        EvalData(test=data.held, ood=ood),
        lambda m, b, split: predict(m, b, f"{name}: {split}", precision=precision, layers=True),
    )
    served = saved_calibration(model)
    rows, _, _ = evaluate_method(name, preds, saved=served)
    plain, as_saved = rows[name], rows[f"{name} (as saved)"]
    main, sets = main_row(as_saved), as_saved.get("sets", {})
    temperature = served.temperature if served is not None else 1.0
    diversity = as_saved.get("diversity", {}).get("id", {})
    return {
        "name": name,
        "members": preds.test.num_members,
        **settings,
        "acc": main["acc"],
        "nll": main["nll"],
        "ece": main["ece"],
        "nll_t1": plain["classification"]["nll"],
        "ece_t1": plain["classification"]["ece"],
        "flag_score": as_saved["flag_score"],
        "auroc": main.get("auroc") if ood else None,
        "fpr95": main.get("fpr95") if ood else None,
        "id_flagged": as_saved["flagged"]["ID test"],
        "set_size": sets.get("mean_size"),
        "set_coverage": sets.get("coverage"),
        "temperature": temperature,
        "disagreement": diversity.get("disagreement", 0.0),
        "member_score_spread": _score_spread(preds.test, as_saved["flag_score"], served),
    }, _per_input(preds, ood, as_saved["flag_score"], temperature, served)


def _score_spread(test, score: str, served) -> float | None:
    """How far the members' feature scores of one input lie apart, relative to how far the
    inputs' scores do: the mean over held-out ID inputs of the members' standard deviation,
    divided by the standard deviation of the ensemble's score over the inputs (0: the members
    score every input alike; None: one member, or a logit score)."""
    statistics = served.flag.statistics if served is not None else None
    if test.num_members < 2 or score not in feature_scores() or statistics is None:
        return None
    members = member_feature_scores(test, score, statistics)
    across = float(members.mean(0).std())
    return float(members.std(0).mean() / across) if across > 0 else None


def _per_input(preds, ood, score: str, temperature, served) -> dict[str, np.ndarray]:
    statistics = served.flag.statistics if served is not None else None
    labels = preds.test.class_labels("held-out validation predictions")
    probs = preds.test.probs(temperature)
    out = {
        "nll": -np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None)),
        "id_score": ood_scores(preds.test, score, temperature, statistics),
    }
    if ood:
        out["ood_score"] = ood_scores(preds.ood[OOD_SET][1], score, temperature, statistics)
    return {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in out.items()}


def write_held(folder: Path, values: dict[str, np.ndarray]) -> Path:
    return atomic_write(folder / HELD, lambda tmp: save_file(values, str(tmp)))


def read_held(folder: Path) -> dict[str, np.ndarray] | None:
    path = folder / HELD
    return load_file(str(path)) if path.is_file() else None


def differences_from_single(
    single: dict[str, np.ndarray], other: dict[str, np.ndarray], resamples: int = RESAMPLES
) -> dict[str, list[float]]:
    """``other`` minus ``single`` on the same held-out inputs, with 95% paired bootstrap intervals
    (the same resamples for every candidate): ``nll`` (mean NLL) and, with OOD data, ``auroc``
    (the flag's AUROC, each with its own flag score): [difference, low, high, p-value]."""
    n_id = len(single["nll"])
    ids = resample_indices(n_id, resamples, salt="sweep-id")
    out = {"nll": _paired(lambda v: resampled_mean(v["nll"], ids), lambda v: v["nll"].mean(), single, other)}
    if "ood_score" in single and "ood_score" in other:
        oods = resample_indices(len(single["ood_score"]), resamples, salt="sweep-ood")
        out["auroc"] = _paired(
            lambda v: resampled_ood(v["id_score"], v["ood_score"], ids, oods)["auroc"],
            lambda v: auroc(v["id_score"], v["ood_score"]),
            single,
            other,
        )
    return out


def _paired(draws, full, single, other) -> list[float]:
    """``other`` minus ``single`` on the full data and over the paired draws (``draws`` maps a
    candidate's values to its metric on every resample, ``full`` to its metric on all of them)."""
    result = paired_difference(draws(other), draws(single), full(other), full(single))
    return [result["difference"], result["low"], result["high"], result["p_value"]]
