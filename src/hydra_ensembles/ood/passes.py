"""Fitting feature scores in passes over blocks of training rows (`FeatureScore.passes`), so that
a fit over data split across processes (`hydra_ensembles.distributed.statistics`) equals the fit
in one process (one block) on the same rows, to float64 rounding, in any order and split.

Each pass summarises every block (`FeatureScore.summarise`), merges the summaries in any order
(`FeatureScore.merge`: sums, Chan et al.'s update of means and spreads, or the rows to keep), and
fits what they determine (`FeatureScore.finish`), which the next pass reads. Spreads are summed
around means fit by an earlier pass, the numerically stable way: one pass over raw moments would
subtract large numbers from large numbers. The helpers below are what the built-in scores'
passes share: class sums and means, scatter and fourth powers (what Ledoit-Wolf's shrinkage
reads, `geometry.shrunk_covariance`), and the mean and spread of a value over the rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .geometry import inverse_covariance, shrunk_covariance
from .registry import Block, PassContext, add, feature_score

__all__ = [
    "add",
    "class_covariance_finish",
    "class_covariance_summary",
    "fit_in_passes",
    "merge_spread",
    "precisions",
    "scatter",
    "spread",
    "spread_summary",
]

Summary = dict[str, np.ndarray]


def scatter(centred: np.ndarray) -> Summary:
    """The scatter ``sum_i c_i c_i^T`` (..., D, D) and ``sum_i |c_i|^4`` (...) of the centred rows
    ``c`` (..., n, D): what `precisions` reads, summed over blocks."""
    squares = (centred**2).sum(-1)
    return {"scatter": np.swapaxes(centred, -1, -2) @ centred, "fourth": (squares**2).sum(-1)}


def precisions(summary: Mapping[str, np.ndarray], n: int, what: str) -> np.ndarray:
    """The inverses of the Ledoit-Wolf covariances (..., D, D) of ``n`` rows from their merged
    `scatter` summary (a pseudo-inverse where there is no spread, with a warning naming ``what``)."""
    spread_, fourth = summary["scatter"], summary["fourth"]
    flat = [
        inverse_covariance(shrunk_covariance(s, float(f), n), what)
        for s, f in zip(spread_.reshape(-1, *spread_.shape[-2:]), fourth.reshape(-1), strict=True)
    ]
    return np.stack(flat).reshape(spread_.shape)


def class_covariance_summary(
    step: int, x: np.ndarray, block: Block, context: PassContext, what: str
) -> Summary:
    """The passes of class means and one covariance around them (``mds``, ``mds++``, each layer of
    ``mds_layers``) over the rows ``x`` (..., n, D) of ``block``: first each class's sum of rows,
    then the `scatter` of the rows around their class's mean (``what.means``)."""
    if step == 0:
        slots = context.class_slots(block.labels)
        sums = np.zeros((*x.shape[:-2], len(context.present), x.shape[-1]))
        for slot in np.unique(slots):  # class by class: no (rows x classes) matrix
            sums[..., slot, :] = x[..., slots == slot, :].sum(-2)
        return {"sums": sums}
    return scatter(x - context.fitted[f"{what}.means"][..., context.class_slots(block.labels), :])


def class_covariance_finish(
    step: int, summary: Mapping[str, np.ndarray], context: PassContext, what: str
) -> Summary:
    """What `class_covariance_summary`'s passes fit: the means of the classes with rows
    (``what.means``, (..., K, D)), then the precision matrix around them (``what.precision``)."""
    if step == 0:
        return {f"{what}.means": summary["sums"] / context.class_counts[context.present][:, None]}
    return {f"{what}.precision": precisions(summary, int(context.settings["examples"]), what)}


def spread_summary(values: np.ndarray) -> Summary:
    """One block's count, mean and sum of squared deviations from it of ``values`` (..., n)."""
    n = values.shape[-1]
    mean = values.mean(-1) if n else np.zeros(values.shape[:-1])
    return {"count": np.asarray(float(n)), "mean": mean, "m2": ((values - mean[..., None]) ** 2).sum(-1)}


def merge_spread(summaries: Sequence[Mapping[str, np.ndarray]]) -> Summary:
    """`spread_summary`s of several blocks in one, in any order (Chan, Golub and LeVeque's update)."""
    total: Summary | None = None
    for part in summaries:
        if float(part["count"]) == 0:
            continue
        if total is None:
            total = {key: np.asarray(value, np.float64).copy() for key, value in part.items()}
            continue
        n_a, n_b = float(total["count"]), float(part["count"])
        delta, n = part["mean"] - total["mean"], n_a + n_b
        total = {
            "count": np.asarray(n),
            "mean": total["mean"] + delta * (n_b / n),
            "m2": total["m2"] + part["m2"] + delta**2 * (n_a * n_b / n),
        }
    if total is None:
        raise ValueError("no rows to merge")
    return total


def spread(summary: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The mean and the (population) standard deviation of a merged `spread_summary`."""
    return summary["mean"], np.sqrt(summary["m2"] / float(summary["count"]))


def summarise_block(
    block: Block, *, step: int, names: Sequence[str], context: PassContext
) -> dict[str, Summary]:
    """Pass ``step``'s summary of ``block`` by each score in ``names``."""
    return {name: feature_score(name).summarise(step, block, context) for name in names}


def fit_in_passes(
    map_blocks: Callable[[Callable[[Block], dict[str, Summary]]], list[dict[str, Summary]]],
    names: Sequence[str],
    context: PassContext,
) -> dict[str, np.ndarray]:
    """The arrays the scores ``names`` fit in their passes over the training rows.
    ``map_blocks(f)``: ``f`` applied to every block of the rows (in one process: the one block of
    all of them; on Ray: each block where it is kept), the results in any order. ``context``: the
    fit's settings, heads, bank rows and class counts (its ``fitted`` is filled pass by pass)."""
    fitted: dict[str, np.ndarray] = {}
    for step in range(max((feature_score(name).passes for name in names), default=0)):
        active = [name for name in names if feature_score(name).passes > step]
        now = dataclasses.replace(context, fitted=dict(fitted))
        results = map_blocks(functools.partial(summarise_block, step=step, names=active, context=now))
        for name in active:
            score = feature_score(name)
            fitted.update(score.finish(step, score.merge(step, [result[name] for result in results]), now))
    return fitted
