"""`run_sweep`: build, calibrate and measure every configuration of a `SweepConfig` on the user's
own data, then time them side by side, draw the frontier and choose within the budget.

Every candidate is calibrated on one half of the ID validation data (and, with OOD validation
data, chooses its flag score on one half of those) and measured on the other halves, so the
measures that rank the candidates were never fit on. Each candidate's model and its measures are
written to ``out/configs/<name>/`` as soon as they exist: a rerun of a killed sweep skips the
finished candidates (and a build resumes its members' training), and its measures are those of a
run never killed. Latency is measured last, every candidate beside the single model in one
interleaved loop (`cost.measure`), so the ratios are of one machine at one time.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..batching import batch_rows, model_inputs, repeat_rows, slice_rows
from ..build import build_hydra, sample_head_sets, save_with_preprocessor
from ..calibration import calibrate
from ..calibration.calibration import check_calibration_data
from ..cost import measure, synchronizer
from ..data.labels import check_same_classes
from ..errors import InputError
from ..evaluation.evaluate import check_flag_score, ood_score_names
from ..hashing import fingerprint, json_digest
from ..loading import load_any
from ..members.ensemble import as_ensemble
from ..precision import model_device, resolve_precision
from ..progress import progress_bar
from ..saving.files import atomic_write_json, check_own_tree
from .frontier import choose, frontier, verdict
from .grid import SINGLE, Candidate, SweepConfig
from .measure import differences_from_single, measure_saved, read_held, write_held

Batches = list[dict[str, Any]]
CONFIGS = "configs"
"""Where the candidates' models and measures are kept, one folder each."""
CHOSEN = "chosen"
"""Where the configuration chosen within the budget is saved, as ``build`` saves a model."""


@dataclass(frozen=True)
class SweepData:
    """The sweep's data as model-input batches: ``train`` (labelled: fine-tuning, feature
    statistics), ``fit`` (labelled ID validation: every calibration and early stopping), ``held``
    (labelled ID validation held out: every measure), and optionally unlabelled OOD validation
    data: ``ood_fit`` (the flag score's choice) and ``ood_held`` (the flag's AUROC and FPR95)."""

    train: Batches | None
    fit: Batches
    held: Batches
    ood_fit: Batches | None = None
    ood_held: Batches | None = None

    def __post_init__(self) -> None:
        if not self.fit or not self.held:
            raise InputError("a sweep needs labelled validation data in both halves (fit and held out)")
        if (self.ood_fit is None) != (self.ood_held is None) or (
            self.ood_fit is not None and not (self.ood_fit and self.ood_held)
        ):
            raise InputError("OOD validation data need both halves (the flag's choice, and held out)")


@dataclass
class SweepResult:
    """One row per candidate (settings, held-out measures, cost, ``frontier``), in the grid's
    order, and the index of the row chosen within the budget (None without one)."""

    rows: list[dict[str, Any]]
    chosen: int | None = None
    verdict: str = ""
    """With a budget, one line saying what the choice rests on (`frontier.verdict`)."""


def model_folder(out: Path, candidate: Candidate) -> Path:
    """Where ``candidate``'s model is saved under the sweep's folder ``out``."""
    folder = out / CONFIGS / candidate.name
    return folder / "model" if candidate.build is None else folder / "build" / "hydra"


@dataclass(frozen=True)
class _Run:
    """One sweep's inputs, as `run_sweep` was given them."""

    model: nn.Module
    ranking: Any
    data: SweepData
    config: SweepConfig
    out: Path
    preprocessor: Any
    log: Callable[[str], None]
    compare: Mapping[str, nn.Module]


def _make(run: _Run, candidate: Candidate) -> None:
    """Build ``candidate`` (or, for the single model or a model compared, calibrate a copy of it)
    and save it."""
    folder, data = run.out / CONFIGS / candidate.name, run.data
    if candidate.build is None:
        single = copy.deepcopy(run.model if candidate.name == SINGLE else run.compare[candidate.name])
        calibration = calibrate(
            single,
            data.fit,
            run.config.calibration,
            data="validation (fit half)",
            precision=run.config.precision,
            id_train=data.train,
            ood_validation=data.ood_fit,
        )
        run.log(f"{candidate.name}: calibration: {calibration.describe()}")
        save_with_preprocessor(single, folder / "model", run.preprocessor)
        return
    built = build_hydra(
        run.model,
        data.train,
        data.fit,
        data.ood_fit,
        config=candidate.build,
        ranking=run.ranking,
        checkpoint_dir=folder / "checkpoints",
        log=run.log,
    )
    built.save_pretrained(folder / "build", run.preprocessor)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def identity(candidate: Candidate, base: str, compare: Mapping[str, nn.Module]) -> str:
    """What ``candidate``'s saved model and measures were made from: the single model's weights
    (``base``: `hashing.fingerprint`), the build's settings or the compared model's weights, and
    the OOD scores its calibration could choose from (a library that offers another score
    measures every candidate again, so that all are compared with the same detectors; the data
    and the shared settings are the sweep's own, which the caller's run key covers)."""
    if candidate.build is not None:
        made = asdict(candidate.build)
    elif candidate.name == SINGLE:
        made = SINGLE
    else:
        made = fingerprint(compare[candidate.name])
    return json_digest({"single": base, "candidate": made, "scores": list(ood_score_names())})


def _quality(run: _Run, candidate: Candidate, made: str) -> dict[str, Any]:
    """``candidate``'s measures: read back where a run finished them from what it is made of now
    (``made``: `identity`), else made and written (a folder made of something else first
    removed; its identity first, its per-input values next, its measures last: the marker of a
    finished candidate)."""
    folder = run.out / CONFIGS / candidate.name
    done, recorded = folder / "result.json", folder / "identity.json"
    same = recorded.is_file() and json.loads(recorded.read_text()).get("identity") == made
    if same and done.is_file() and read_held(folder) is not None:
        run.log(f"{candidate.name}: finished earlier, kept")
        return json.loads(done.read_text())
    if not same:
        shutil.rmtree(folder, ignore_errors=True)
        atomic_write_json(recorded, {"identity": made})
    if not done.is_file():
        _make(run, candidate)
    result, held = measure_saved(
        candidate.name, candidate.describe(), model_folder(run.out, candidate), run.data, run.config.precision
    )
    write_held(folder, held)
    atomic_write_json(done, result)
    return result


def _add_differences(rows: list[dict[str, Any]], out: Path) -> None:
    """Each row's paired bootstrap difference from the single model (`differences_from_single`),
    flattened: ``<metric>_vs_single`` and its ``_low``, ``_high`` and ``_p`` (0 for the single
    model itself)."""
    single = read_held(out / CONFIGS / SINGLE)
    for row in rows:
        if row["name"] == SINGLE:
            metrics = ("nll", "auroc") if row["auroc"] is not None else ("nll",)
            found = {m: [0.0, 0.0, 0.0, 1.0] for m in metrics}
        else:
            found = differences_from_single(single, read_held(out / CONFIGS / row["name"]))
        for metric, (difference, low, high, p) in found.items():
            row[f"{metric}_vs_single"] = difference
            row[f"{metric}_vs_single_low"], row[f"{metric}_vs_single_high"] = low, high
            row[f"{metric}_vs_single_p"] = p


def _timing_inputs(held: Batches, rows: int) -> dict[str, torch.Tensor]:
    """``rows`` inputs cut from the first held-out batch (its rows repeated where it has fewer)."""
    batch = model_inputs(held[0])
    size = batch_rows(batch)
    times = -(-rows // size)
    return slice_rows(repeat_rows(batch, times, size), 0, rows, size * times)


def _cost(
    candidates: Sequence[Candidate], out: Path, data: SweepData, config: SweepConfig
) -> dict[str, dict]:
    """Each candidate's latency at every batch size (median ms, and its ratio to the single
    model's in the same interleaved loop), multiply-adds per input and weight memory."""
    models = {c.name: as_ensemble(load_any(str(model_folder(out, c)))).eval() for c in candidates}
    device = model_device(list(models.values()))
    compute = resolve_precision(config.precision, device)
    cost: dict[str, dict] = {
        name: {"weights_mb": sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20}
        for name, m in models.items()
    }
    largest = max(config.batch_sizes)
    for size in sorted(config.batch_sizes):
        inputs = {k: v.to(device) for k, v in _timing_inputs(data.held, size).items()}
        runs = {name: partial(m, **inputs) for name, m in models.items()}
        with compute.autocast(device):
            timed = measure(
                runs, repeats=config.repeats, sync=synchronizer(device), count_macs=size == largest
            )
        for name, t in timed.items():
            cost[name][f"ms@{size}"] = t["median_ms"]
            cost[name][f"latency_ratio@{size}"] = t["median_ms"] / timed[SINGLE]["median_ms"]
            if "gmacs" in t:
                cost[name]["gmacs_per_input"] = t["gmacs"] / size
    for name in cost:
        cost[name]["latency_ratio"] = cost[name][f"latency_ratio@{largest}"]
    return cost


def check_sweep(
    model: nn.Module,
    ranking: Any,
    data: SweepData,
    config: SweepConfig,
    compare: Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """``config``'s candidates, each checked against ``model``, ``ranking`` and ``data`` before the
    first is made (InputError naming what to change): the calibration data
    (`check_calibration_data`), the flag score for every candidate (the single model's included:
    `check_flag_score`), every build's members cut from the ranking (`sample_head_sets`), and
    every compared model's classes (the same as the model's, in its order: `check_same_classes`)."""
    compare = compare or {}
    candidates = config.candidates(tuple(compare))
    if config.prefer == "auroc" and data.ood_fit is None:
        raise InputError("--prefer auroc weighs the flag's AUROC: give OOD validation data (--ood-data)")
    check_calibration_data(data.fit, config.calibration, model)
    score = config.calibration.score
    for name, other in compare.items():  # measured against labels numbered as the model's
        members = list(other) if isinstance(other, (list, tuple)) else [other]
        try:
            check_same_classes([model, *members])
        except InputError as exc:
            raise InputError(f"--compare {name}: {exc}") from None
        check_flag_score(score, as_ensemble(other).num_members, name)
    check_flag_score(score, 1, f"the sweep's {SINGLE!r} candidate (always measured)")
    with warnings.catch_warnings():  # said again where the candidate is built
        warnings.simplefilter("ignore")
        for candidate in candidates:
            if candidate.build is not None:
                try:
                    sample_head_sets(model, ranking, candidate.build)
                except InputError as exc:
                    raise InputError(f"{candidate.name}: {exc}") from None
    return candidates


def run_sweep(
    model: nn.Module,
    ranking: Any,
    data: SweepData,
    config: SweepConfig,
    out: str | Path,
    *,
    preprocessor: Any = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    compare: Mapping[str, Any] | None = None,
) -> SweepResult:
    """Build, calibrate and measure every candidate of ``config`` (the module docstring) in the
    folder ``out`` (claimed by the caller), then time them; with ``config.budget``, save the chosen
    one to ``out/chosen`` (`frontier.choose`). ``ranking``: what `build_hydra` samples members from.
    ``compare``: name -> a model measured, calibrated and timed beside the others as it is (a deep
    ensemble: a list of models, or any model `as_ensemble` takes), e.g. to weigh a deep ensemble
    you trained against the fused models; it must read the inputs ``data`` was made with."""
    out = Path(out)
    for own in (CONFIGS, CHOSEN):  # nothing is read back or kept through what this run did not make
        check_own_tree(out / own)
    candidates = check_sweep(model, ranking, data, config, compare)
    compare = {n: as_ensemble(m) if isinstance(m, (list, tuple)) else m for n, m in (compare or {}).items()}
    run = _Run(model, ranking, data, config, out, preprocessor, log, compare)
    base = fingerprint(model)
    rows = [
        _quality(run, c, identity(c, base, compare))
        for c in progress_bar(candidates, desc="sweep", unit="config", enabled=progress)
    ]
    log(f"timing {len(candidates)} configurations side by side at batch sizes {list(config.batch_sizes)}")
    cost = _cost(candidates, out, data, config)
    for row in rows:
        row.update(cost[row["name"]])
    _add_differences(rows, out)
    for row, on in zip(rows, frontier(rows), strict=True):
        row["frontier"] = on
    chosen, said = None, ""
    if config.budget is not None:
        chosen = choose(rows, config.budget, prefer=config.prefer)
        said = verdict(rows, chosen, config.budget, config.prefer)
        log(said)
        _save_chosen(model_folder(out, candidates[chosen]), out / CHOSEN, out / CONFIGS)
    elif (out / CHOSEN).is_dir() and not (out / CHOSEN).is_symlink():  # an earlier budget's choice
        shutil.rmtree(out / CHOSEN)
    return SweepResult(rows, chosen, said)


def _save_chosen(source: Path, target: Path, staging_in: Path) -> Path:
    """A copy of the chosen model's folder at ``target``, whole or not at all: copied into a new
    folder under ``staging_in`` (inside the sweep's own folder, where a killed run's leftovers
    stay out of the way), then renamed into place; a previous copy is removed first (a killed
    run leaves ``target`` missing, never a mix, and the unfinished sweep makes it again)."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise InputError(f"{target} is not a folder this sweep wrote: remove it or choose another --out")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=staging_in))
    try:
        shutil.copytree(source, staging / target.name, symlinks=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging / target.name, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
