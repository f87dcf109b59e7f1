"""From one classifier and labelled data to a fused, calibrated Hydra model: the whole method as one
call (`build_hydra`), which ``hydra-ens build`` runs with flags.

    config = BuildConfig(num_pruned=24, fine_tune=FineTuneConfig(epochs=1))
    built = build_hydra(model, train, validation, config=config)
    built.save_pretrained("built/", preprocessor=tokenizer)

Steps: rank the heads (a given ranking; else greedy circuit extraction where OOD validation data
is given, Taylor importance on the ID validation data otherwise), sample diverse members, prune,
fine-tune each member (optional, resumable per member), fuse, and fit the temperature and the OOD
flag threshold on the labelled ID validation data (`calibration.calibrate`): the fused model, and,
with fine-tuned members, their explicit ensemble, each carry their own calibration. OOD data is
only ever used to rank heads, never to calibrate.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import get_adapter
from .batching import bootstrap_batches, pad_id
from .calibration.calibration import Calibration, check_calibration_data
from .calibration.fit import calibrate
from .calibration.settings import CalibrationConfig
from .errors import InputError
from .evaluation.evaluate import check_flag_score
from .fusion import fuse
from .fusion.model import HydraModel
from .heads import HeadSet
from .inputs import checked_batches
from .members import sample_members
from .members.ensemble import DeepEnsemble, write_ensemble_index
from .members.sampling import check_shared_layers
from .saving.formats import SavedFormat, save_model
from .scoring import CircuitConfig, CircuitOrder, extract_circuit, taylor_scores
from .surgery import original_heads_per_layer, prune, prune_mlp
from .training import FineTuneConfig, FineTuneResult, describe_epoch, fine_tune

__all__ = [
    "Build",
    "BuildConfig",
    "build_hydra",
    "name_classes",
    "save_preprocessor",
    "save_with_preprocessor",
]

Ranking = CircuitOrder | torch.Tensor


@dataclass(frozen=True)
class BuildConfig:
    """How `build_hydra` builds: give exactly one of ``num_pruned`` (heads each member prunes in
    total) or ``heads_per_layer`` (heads each member keeps per layer); ``pool_size`` is the number
    of least useful heads members are sampled from (`members.sample_members`); ``budget`` the
    heads circuit extraction ranks (default: the pool, or twice the heads pruned). ``fine_tune``:
    None leaves the members untrained (fusion is then exact); member m trains
    with seed ``fine_tune.seed + m``. ``shared_layers=k`` gives every member member 0's heads in
    the first k layers and fine-tunes only the blocks after them (a shared trunk, which `fuse`
    runs once: the cost knob of the fused model). ``bootstrap``: member m fine-tunes on its own
    bootstrap resample of ``train`` (`batching.bootstrap_batches`, seed ``fine_tune.seed + m``):
    bagging, for members that differ in their data too. ``keep_base``: member 0 is ``model``
    itself, unpruned and not trained again (the single model inside the ensemble); the other
    ``num_members - 1`` are sampled and trained as usual. ``mlp_keep``: the share of each
    layer's MLP neurons the members keep (`surgery.prune_mlp`, the same neurons for every member,
    chosen on ``model``'s weights): a narrower merged MLP, the second cost knob; the members are
    then fine-tuned (it needs ``fine_tune``). ``num_pruned=0``: a deep ensemble of fine-tunes
    (`deep_ensemble`). ``lora_rank``: each member fine-tunes LoRA adapters of that rank on W_Q
    and W_V (its task head in full), merged into its weights (`baselines.lora_fine_tune`; not
    checkpointed within a member): with ``num_pruned=0``, a LoRA-Ensemble. ``calibration``
    (`CalibrationConfig`) sets the OOD flag and the prediction sets; by default the flag score is
    ``"auto"``
    (`evaluation.choose_flag_score`, a feature score where training data is given) and the sets
    are ``lac`` at level 0.1."""

    num_members: int = 3
    num_pruned: int | None = None
    heads_per_layer: int | None = None
    pool_size: int | None = None
    budget: int | None = None
    seed: int = 0
    shared_layers: int = 0
    fine_tune: FineTuneConfig | None = None
    bootstrap: bool = False
    keep_base: bool = False
    mlp_keep: float = 1.0
    mlp: str = "merge"
    lora_rank: int | None = None
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    precision: str = "auto"
    circuit: CircuitConfig | None = None
    """The circuit extraction's other settings (objective, method, cache, ...) where heads are
    ranked by circuit extraction; its budget and precision are the build's (``budget``,
    ``precision``)."""

    def __post_init__(self) -> None:
        """``precision`` is the one precision of every step of a build: a nested setting that
        names another is refused rather than silently replaced (``auto`` defers to it)."""
        if self.keep_base and (self.num_members < 2 or self.shared_layers):
            raise InputError(
                "keep_base adds pruned members to the model itself: it needs num_members >= 2 and "
                "no shared_layers (the model keeps every head in every layer)"
            )
        if (
            isinstance(self.mlp_keep, bool)
            or not isinstance(self.mlp_keep, (int, float))
            or not 0 < self.mlp_keep <= 1
        ):
            raise InputError(f"mlp_keep is the share of MLP neurons kept, in (0, 1], got {self.mlp_keep!r}")
        if self.mlp_keep < 1 and (self.fine_tune is None or self.keep_base):
            raise InputError(
                "mlp_keep < 1 changes every member's MLP: it needs fine_tune (to recover) and no keep_base "
                "(the model keeps its whole MLP, which a merged MLP cannot hold beside narrower ones)"
            )
        if self.bootstrap and self.fine_tune is None:
            raise InputError("bootstrap resamples the members' training data: it needs fine_tune")
        if self.lora_rank is not None and (self.fine_tune is None or self.lora_rank < 1):
            raise InputError(
                f"lora_rank trains LoRA adapters: it needs fine_tune and a rank >= 1, got {self.lora_rank}"
            )
        if self.deep_ensemble and (
            self.fine_tune is None or self.keep_base or self.shared_layers or self.mlp != "exact"
        ):
            raise InputError(
                "num_pruned=0: members that keep every head differ only by their fine-tuning (a deep "
                "ensemble): it needs fine_tune and mlp='exact' (every part per member, so the fused "
                "model is their ensemble), and no keep_base or shared_layers"
            )
        for name, nested in (("fine_tune", self.fine_tune), ("circuit", self.circuit)):
            if nested is not None and nested.precision not in ("auto", self.precision):
                raise InputError(
                    f"{name}.precision={nested.precision!r} differs from the build's "
                    f"precision={self.precision!r}, which every step of a build computes in: "
                    "set BuildConfig(precision=...) and leave the nested one 'auto'"
                )

    @property
    def deep_ensemble(self) -> bool:
        """``num_pruned=0``: every member keeps every head, fine-tuned with its own seed (a deep
        ensemble of fine-tunes, fused into one model); no ranking is read or computed."""
        return self.num_pruned == 0


@dataclass
class Build:
    """What `build_hydra` made: the fused model, its members (pruned, maybe fine-tuned), their head
    sets, the ranking they were sampled from, each member's training history, and the fused
    model's and the members' ensemble's calibrations (None without validation data)."""

    hydra: HydraModel
    members: list[nn.Module]
    head_sets: list[HeadSet]
    ranking: Ranking | None
    histories: list[FineTuneResult] = field(default_factory=list)
    calibration: Calibration | None = None
    members_calibration: Calibration | None = None

    def save_pretrained(
        self, out: str | os.PathLike, preprocessor: Any = None, members_saved: bool = False
    ) -> Path:
        """``out/hydra`` (the fused model) and, for fine-tuned members, ``out/members`` (each member
        and their ensemble, which `DeepEnsemble.from_pretrained` loads), each with the preprocessor
        saved beside the model; the fused model's config is written last. ``members_saved``: the
        members are in ``out/members/member-<m>`` already (saved as each was trained)."""
        out = Path(out)
        if self.histories:
            names = [f"member-{m}" for m in range(len(self.members))]
            for name, member in zip(names, self.members, strict=True):
                if not members_saved:
                    save_with_preprocessor(member, out / "members" / name, preprocessor)
            save_preprocessor(preprocessor, out / "members")
            calibration = self.members_calibration
            members = calibration.to_dict() if calibration else None
            statistics = calibration.flag.statistics if calibration else None
            write_ensemble_index(out / "members", names, self.members[0].config, members, statistics)
        save_with_preprocessor(self.hydra, out / "hydra", preprocessor)
        return out


def narrow_mlp(model: nn.Module, share: float, say: Callable[[str], None] | None = None) -> nn.Module:
    """A copy of ``model`` with ``share`` of its MLP neurons in every layer (at least one;
    `surgery.prune_mlp`): what `BuildConfig.mlp_keep` prunes before the members are cut."""
    width = get_adapter(model).mlp_width(model)
    keep = max(1, round(share * width))
    if say is not None:
        say(f"pruning every layer's MLP to {keep} of its {width} neurons (the same for every member)")
    return prune_mlp(model, keep)


def build_hydra(
    model: nn.Module,
    train: Sequence[dict[str, Any]] | None = None,
    validation: Sequence[dict[str, Any]] | None = None,
    ood_validation: Sequence[dict[str, Any]] | None = None,
    config: BuildConfig = BuildConfig(),
    *,
    ranking: Ranking | None = None,
    classes: Sequence[str] | None = None,
    validation_name: str = "",
    train_name: str = "",
    checkpoint_dir: str | os.PathLike | None = None,
    on_member: Callable[[int, nn.Module, FineTuneResult], None] | None = None,
    make_member: Callable[[int, HeadSet], nn.Module] | None = None,
    statistics: Callable[[nn.Module], tuple[Any, Any]] | None = None,
    log: Callable[[str], None] | None = None,
    progress: bool = True,
) -> Build:
    """Build a fused, calibrated Hydra model from ``model``, a fine-tuned classifier (the module
    docstring). ``train``, ``validation``: labelled batches; ``validation`` (ID) ranks heads by
    Taylor importance without ``ranking`` or ``ood_validation``, stops fine-tuning (``patience``)
    and fits the calibration (its statistics on ``train``); ``ood_validation``: unlabelled OOD
    batches for circuit extraction and the ``"auto"`` flag score. ``classes`` name the classes;
    ``checkpoint_dir`` keeps each member's checkpoints (``member-<m>/``: a rerun resumes);
    ``on_member(m, member, result)`` follows each member's training, ``log`` gets one line per step;
    ``make_member(m, head_set)`` replaces pruning and training member m (a cache plugs in here);
    ``statistics(model)`` = (statistics, `DataRecord`) of a built model replaces their fit on
    ``train`` here (`_calibrate`)."""
    say = log or (_to_stderr if progress else (lambda line: None))  # each step said as it starts
    train, validation = _checked_data(model, train, validation, config)
    if ranking is None and not config.deep_ensemble:
        ranking = _rank(model, validation, ood_validation, config, progress, say)
    head_sets = sample_head_sets(model, ranking, config, say)
    histories = []
    if make_member is not None:
        members = [make_member(m, hs) for m, hs in enumerate(head_sets)]
    else:
        narrow = model if config.mlp_keep == 1 else narrow_mlp(model, config.mlp_keep, say)
        members = [name_classes(prune(narrow, hs), classes) for hs in head_sets]
        if config.fine_tune is not None:
            train_one = functools.partial(_train_member, train, validation, config, progress)
            histories = _fine_tune_members(members, train_one, config, checkpoint_dir, on_member, say)
    say(f"fusing {len(members)} members into one model")
    built = Build(fuse(members, mlp=config.mlp), members, head_sets, ranking, histories)
    if validation:
        calibrate_one = functools.partial(
            _calibrate, data=(validation, validation_name), train=(train, train_name),
            ood_validation=ood_validation, config=config, progress=progress, statistics=statistics,
        )  # fmt: skip
        _calibrate_built(built, calibrate_one, bool(train) or statistics is not None, say)
    return built


def sample_head_sets(
    model: nn.Module, ranking: Ranking, config: BuildConfig, say: Callable[[str], None] = lambda line: None
) -> list[HeadSet]:
    """The members' head sets: sampled from ``ranking`` (with ``keep_base``, every head of
    ``model`` first, then M - 1 sampled); InputError where ``config`` cannot be cut from ``model``
    and ``ranking`` (cheap: what a sweep checks of every build before the first is made)."""
    if config.deep_ensemble:
        say(f"{config.num_members} members keeping every head (a deep ensemble of fine-tunes)")
        return [HeadSet.full(original_heads_per_layer(model))] * config.num_members
    sampled = config.num_members - config.keep_base
    say(
        f"sampling {sampled} members' head sets from the ranking"
        + (" (member 1: the model)" if config.keep_base else "")
    )
    head_sets = sample_members(
        ranking,
        sampled,
        heads_per_layer=config.heads_per_layer,
        num_pruned=config.num_pruned,
        pool_size=config.pool_size,
        seed=config.seed,
        shared_layers=config.shared_layers,
    )
    if config.keep_base:
        head_sets = [HeadSet.full(original_heads_per_layer(model)), *head_sets]
    return head_sets


def _calibrate_built(built: Build, calibrate_one: Callable, statistics: bool, say: Callable) -> None:
    """Calibrate the fused model and, for fine-tuned members, their explicit ensemble (as one
    model), recording both in ``built``."""
    if built.histories:
        say("calibrating the members' ensemble")
        built.members_calibration = calibrate_one(DeepEnsemble(built.members))
    say("calibrating the fused model" + (" (feature statistics on the training data)" if statistics else ""))
    built.calibration = calibrate_one(built.hydra)


def _checked_data(model: nn.Module, train, validation, config: BuildConfig) -> tuple[list, list]:
    """The labelled training and validation batches as lists, checked against the model's classes
    (and the validation data against what the calibration needs: `check_calibration_data`) before any work."""
    train, validation = _listed(train), _listed(validation)
    classes_of_model = int(model.config.num_labels)
    train = train and checked_batches(train, "train", classes_of_model, model=model)
    validation = validation and checked_batches(validation, "validation", classes_of_model, model=model)
    if validation:
        check_calibration_data(validation, config.calibration, model)
        check_flag_score(config.calibration.score, config.num_members, "a model of one member")
    check_shared_layers(config.shared_layers, len(original_heads_per_layer(model)))
    if config.fine_tune is not None and not train:
        raise InputError("fine-tuning members needs labelled training batches (train)")
    return train, validation


def _to_stderr(line: str) -> None:
    print(f"build_hydra: {line}", file=sys.stderr, flush=True)


def _train_member(
    train: Sequence[dict[str, Any]],
    validation: Sequence[dict[str, Any]] | None,
    build: BuildConfig,
    progress: bool,
    member: nn.Module,
    m: int,
    config: FineTuneConfig,
    **options: Any,
) -> FineTuneResult:
    """Fine-tune member ``m`` on ``train`` (its own bootstrap resample of it with
    ``build.bootstrap``), in full or, with ``build.lora_rank``, by LoRA adapters merged into it."""
    if build.bootstrap:
        train = bootstrap_batches(list(train), config.seed, pad_id(member))
    if build.lora_rank is None:
        return fine_tune(member, train=train, val=validation, config=config, progress=progress, **options)
    from .baselines.lora import lora_fine_tune

    merged, result = lora_fine_tune(
        member, train, validation, config, rank=build.lora_rank, progress=progress
    )
    member.load_state_dict(merged.state_dict())  # in place, as a full fine-tune trains it
    return result


def _fine_tune_members(
    members: list[nn.Module],
    train_one: Callable[..., FineTuneResult],
    config: BuildConfig,
    checkpoint_dir: str | os.PathLike | None,
    on_member: Callable[[int, nn.Module, FineTuneResult], None] | None,
    say: Callable[[str], None],
) -> list[FineTuneResult]:
    """Fine-tune each member in turn (member m with seed ``seed + m``, checkpoints under
    ``checkpoint_dir/member-<m>``), calling ``on_member`` after each."""
    histories, started = [], time.monotonic()
    for m, member in enumerate(members):
        settings = dataclasses.replace(
            config.fine_tune, seed=config.fine_tune.seed + m, precision=config.precision
        )
        if config.shared_layers:  # the shared trunk stays the base's, so that fuse runs it once
            after = len(original_heads_per_layer(member)) - config.shared_layers
            if settings.last_k_blocks is not None:
                after = min(after, settings.last_k_blocks)
            settings = dataclasses.replace(settings, last_k_blocks=after)
        per_member = (time.monotonic() - started) / m if m else None
        left = f" (about {per_member * (len(members) - m):.0f} s left)" if per_member else ""
        say(f"fine-tuning member {m + 1} of {len(members)}{left}")
        folder = None if checkpoint_dir is None else Path(checkpoint_dir) / f"member-{m}"

        def said(record: dict, m: int = m) -> None:
            say(f"member {m + 1}: {describe_epoch(record)}")

        if m == 0 and config.keep_base:
            say("member 1 is the model itself: not trained again")
            result = FineTuneResult()
        else:
            result = train_one(member, m, config=settings, checkpoint_dir=folder, on_epoch=said)
        histories.append(result)
        if on_member is not None:
            on_member(m, member, result)
    return histories


def _listed(batches: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return None if batches is None else list(batches)


def _rank(model, validation, ood_validation, config: BuildConfig, progress: bool, say) -> Ranking:
    """Circuit extraction with OOD validation data, Taylor importance without."""
    if not validation:
        raise InputError("ranking heads needs labelled ID validation batches (validation), or give ranking")
    if ood_validation is None:
        say("ranking heads by Taylor importance on the ID validation data")
        return taylor_scores(model, validation, progress=progress, precision=config.precision)
    pruned = config.num_pruned or 0
    budget = config.budget or config.pool_size or 2 * pruned
    if not budget:
        raise InputError("circuit extraction needs a budget: give budget, pool_size or num_pruned")
    say(f"ranking heads by circuit extraction (budget {budget}) on ID and OOD validation data")
    settings = dataclasses.replace(
        config.circuit or CircuitConfig(), budget=budget, precision=config.precision
    )
    return extract_circuit(model, validation, list(ood_validation), settings, progress=progress)


def _calibrate(
    model, *, data, train, ood_validation, config: BuildConfig, progress: bool, statistics=None
) -> Calibration:
    """``model``'s calibration on ``data`` = (validation batches, name), with feature statistics
    fit on ``train`` = (training batches or None, name), or by ``statistics(model)`` (the fused
    model; the members' ensemble) = (`FeatureStatistics`, `DataRecord` of their data): ``train``
    then only fine-tunes (`distributed.fit_statistics_dataset` fits them on Ray)."""
    (validation, name), (train_batches, train_name) = data, train
    if statistics is not None:
        fitted, record = statistics(model)
        return calibrate(
            model, validation, config.calibration, data=name, precision=config.precision, progress=progress,
            statistics=fitted, statistics_data=record, ood_validation=ood_validation,
        )  # fmt: skip
    return calibrate(
        model,
        validation,
        config.calibration,
        data=name,
        precision=config.precision,
        progress=progress,  # the statistics' and the validation data's forward passes
        id_train=train_batches or None,
        train_data=train_name,
        ood_validation=ood_validation,
    )


def name_classes(model: nn.Module, classes: Sequence[str] | None) -> nn.Module:
    """Record class names in ``model.config`` (where they fit its head), so saved models and
    pipelines name their predictions; returns ``model``."""
    if classes and len(classes) == model.config.num_labels:
        model.config.id2label = dict(enumerate(classes))
        model.config.label2id = {name: i for i, name in enumerate(classes)}
    return model


def save_with_preprocessor(
    model: nn.Module, folder: Path, preprocessor: Any = None, saved: SavedFormat | None = None
) -> Path:
    """The preprocessor first (its files are then covered by the model's checksums), then the
    model in the format ``saved`` (a format it was read in: the registered ones, or
    `members.storage.CLASSIFIER`), by default its own (`saving.formats.save_model`)."""
    save_preprocessor(preprocessor, folder)
    return save_model(model, folder) if saved is None else saved.save(model, Path(folder))


def save_preprocessor(preprocessor: Any, folder: Path) -> None:
    """Save the tokenizer or image processor into ``folder`` (nothing for None), so that predict,
    export and pipelines find it beside the model."""
    if preprocessor is not None:
        folder.mkdir(parents=True, exist_ok=True)
        preprocessor.save_pretrained(folder)
