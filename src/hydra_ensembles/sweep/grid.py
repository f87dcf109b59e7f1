"""The configurations a sweep compares: the single model, and one Hydra build per point of a grid."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from ..build import BuildConfig
from ..calibration import CalibrationConfig
from ..errors import InputError
from ..training import FineTuneConfig

SINGLE = "single"
"""The name of the model the sweep starts from (its calibration fit like every other candidate's:
the single model with temperature scaling, its feature statistics and flag)."""


@dataclass(frozen=True)
class Candidate:
    """One configuration of a sweep: ``build`` None is the single model itself."""

    name: str
    build: BuildConfig | None = None

    def describe(self) -> dict[str, object]:
        """The settings a results table shows for this candidate (its members are counted where
        it is measured)."""
        if self.build is None:
            return {"num_pruned": 0, "shared_layers": 0, "keep_base": False, "mlp_keep": 1.0}
        b = self.build
        return {
            "members": b.num_members,
            "num_pruned": b.num_pruned,
            "shared_layers": b.shared_layers,
            "keep_base": b.keep_base,
            "mlp_keep": b.mlp_keep,
        }


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _checked_name(name: str) -> str:
    """``name`` where it can name a folder of the sweep's (letters, digits, ``_.-``), else InputError."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.endswith("."):
        raise InputError(f"a compared model's name must be letters, digits, '_', '.' or '-', got {name!r}")
    return name


def _values(name: str, values: tuple, minimum: int) -> tuple:
    if not values:
        raise InputError(f"the sweep's {name} need at least one value")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < minimum]
    if bad:
        raise InputError(f"the sweep's {name} must be whole numbers >= {minimum}, got {bad[0]!r}")
    if len(set(values)) != len(values):
        raise InputError(f"the sweep's {name} list a value twice: {list(values)}")
    return tuple(values)


@dataclass(frozen=True)
class SweepConfig:
    """The grid of a sweep (`run_sweep`): every combination of ``members`` x ``num_pruned`` x
    ``shared_layers`` x ``keep_base`` x ``mlp_keep`` is one Hydra build (combinations
    `BuildConfig` refuses, a shared trunk or a narrower MLP beside the unpruned model, are left
    out), beside the single model; ``num_pruned`` 0 is the fused deep ensemble of fine-tunes of
    ``members`` members (``deep-m<M>``, every part per member), once per member count; with
    ``lora_rank`` R, the fused LoRA-Ensemble of ``members`` members (``lora-m<M>-r<R>``: each
    member's LoRA adapters of rank R merged, what they share one module) is a candidate too, once
    per member count. Every build
    shares ``fine_tune``, ``bootstrap``, ``seed``, ``calibration`` and ``precision``. The cost is
    measured at ``batch_sizes`` with ``repeats`` interleaved rounds; ``budget``: the largest
    latency ratio to the single model (at the largest batch size) of the configuration chosen."""

    members: tuple[int, ...] = (2, 3)
    num_pruned: tuple[int, ...] = ()
    shared_layers: tuple[int, ...] = (0,)
    keep_base: tuple[bool, ...] = (False,)
    mlp_keep: tuple[float, ...] = (1.0,)
    fine_tune: FineTuneConfig | None = None
    bootstrap: bool = False
    seed: int = 0
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    precision: str = "auto"
    batch_sizes: tuple[int, ...] = (1, 64)
    repeats: int = 5
    budget: float | None = None
    lora_rank: int | None = None
    prefer: str | None = None
    """The measure a candidate must be significantly better on to replace the single model
    (``auroc`` or ``nll``; None: the flag's AUROC where OOD validation data measure it, else NLL)."""

    def __post_init__(self) -> None:
        _values("members", self.members, 2)
        _values("num_pruned", self.num_pruned, 0)
        if 0 in self.num_pruned and self.fine_tune is None:
            raise InputError(
                "num_pruned 0 is a deep ensemble of fine-tunes (every head kept): the sweep needs fine_tune"
            )
        if self.lora_rank is not None and (self.fine_tune is None or self.lora_rank < 1):
            raise InputError(
                f"lora_rank adds the LoRA-Ensemble of fine-tunes: it needs fine_tune and a rank >= 1, "
                f"got {self.lora_rank}"
            )
        _values("shared_layers", self.shared_layers, 0)
        _values("batch_sizes", self.batch_sizes, 1)
        shares = self.mlp_keep
        if not shares or len(set(shares)) != len(shares) or not all(0 < v <= 1 for v in shares):
            raise InputError(f"the sweep's mlp_keep must be distinct shares in (0, 1], got {shares}")
        if not self.keep_base or len(set(self.keep_base)) != len(self.keep_base):
            raise InputError(f"keep_base lists each of False/True at most once, got {self.keep_base}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise InputError(f"repeats must be a positive whole number, got {self.repeats!r}")
        if self.prefer not in (None, "auroc", "nll"):
            raise InputError(f"prefer is 'auroc' or 'nll' (or None), got {self.prefer!r}")
        if self.budget is not None and not 1 <= self.budget < float("inf"):
            raise InputError(
                f"the budget is a latency ratio to the single model, a finite number >= 1; got {self.budget}"
            )

    def _build(self, members: int, **settings: Any) -> BuildConfig:
        """The build of ``members`` members with ``settings`` (what sets a candidate of the grid
        apart) and the sweep's shared settings."""
        return BuildConfig(
            num_members=members,
            seed=self.seed,
            fine_tune=self.fine_tune,
            bootstrap=self.bootstrap,
            calibration=self.calibration,
            precision=self.precision,
            **settings,
        )

    def candidates(self, compared: tuple[str, ...] = ()) -> list[Candidate]:
        """The single model, the models ``compared`` (as they are), then every build of the grid,
        named by its settings; a compared name that is taken or no folder name is refused."""
        out = [Candidate(SINGLE), *(Candidate(_checked_name(name)) for name in compared)]
        grid = itertools.product(
            self.members, self.num_pruned, self.shared_layers, self.keep_base, self.mlp_keep
        )
        for members, pruned, trunk, keep, mlp in grid:
            if pruned == 0 and not (keep or trunk or mlp < 1):
                out.append(Candidate(f"deep-m{members}", self._build(members, num_pruned=0, mlp="exact")))
            if pruned == 0 or (keep and (trunk or mlp < 1)):
                continue
            build = self._build(members, num_pruned=pruned, shared_layers=trunk, keep_base=keep, mlp_keep=mlp)
            name = f"hydra-m{members}-p{pruned}-t{trunk}" + ("-base" if keep else "")
            name += f"-mlp{round(100 * mlp)}" if mlp < 1 else ""
            out.append(Candidate(name, build))
        if self.lora_rank is not None:
            rank = self.lora_rank
            out += [
                Candidate(f"lora-m{m}-r{rank}", self._build(m, num_pruned=0, mlp="exact", lora_rank=rank))
                for m in self.members
            ]
        names = [c.name for c in out]
        if len(set(names)) != len(names):
            raise InputError(f"a compared model is named like a configuration of the sweep: {names}")
        return out
