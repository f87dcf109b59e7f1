"""Fine-tuning checkpoints: after every epoch the weights, the optimizer state and the
`TrainingState` (epochs done, history, best validation NLL and weights) are saved as one file set
(`io.save_file_set`), safetensors and JSON only; a rerun resumes only the same run (same starting
weights, data, settings and precision)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import InputError
from ..hashing import batches_digest, fingerprint, json_digest
from ..saving.files import MANIFEST, load_file_set, save_file_set
from .config import FineTuneConfig
from .records import FineTuneResult


class CheckpointError(InputError):
    """A fine-tuning checkpoint cannot resume this run (another run's, or damaged)."""


@dataclass
class TrainingState:
    """Where a run stands between epochs (what a checkpoint holds beside the weights and the
    optimizer state)."""

    epochs_done: int = 0
    result: FineTuneResult = field(default_factory=FineTuneResult)
    best_nll: float = math.inf
    best_state: dict[str, torch.Tensor] | None = None
    """The weights of the best validation NLL so far (on the CPU), for early stopping."""


@dataclass(frozen=True)
class CheckpointDir:
    """The checkpoint folder of one run: ``inputs`` is the digest of its starting weights and data
    (`inputs_digest`), ``precision`` the precision it computes in; both must match to resume."""

    path: Path
    inputs: str
    precision: str

    def exists(self) -> bool:
        return has_checkpoint(self.path)

    def save(self, state: TrainingState, model: nn.Module, optimizer, config: FineTuneConfig) -> None:
        """The epoch's weights, optimizer state, best weights and state, saved as one set: a kill
        between two files resumes from the previous epoch, never from a mix of two."""
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        tensors, meta = _optimizer_tensors(optimizer)
        files = {
            "model.safetensors": lambda tmp: save_file(weights, str(tmp)),
            "optimizer.safetensors": lambda tmp: save_file(tensors, str(tmp)),
        }
        if state.best_state is not None:
            best_state = state.best_state
            files["best.safetensors"] = lambda tmp: save_file(best_state, str(tmp))
        record = {
            "epochs_done": state.epochs_done,
            "config": config_json(config),
            "history": state.result.history,
            "best_epoch": state.result.best_epoch,
            "best_nll": state.best_nll if math.isfinite(state.best_nll) else None,
            "optimizer": meta,
            "inputs_sha256": self.inputs,
            "precision": self.precision,
        }
        save_file_set(self.path, files, record)

    def load(self, model: nn.Module, optimizer, config: FineTuneConfig) -> TrainingState:
        """The saved state, with ``model`` and ``optimizer`` restored; CheckpointError where it
        belongs to another run or is damaged."""
        try:
            return _restore(self.path, model, optimizer, config, self.inputs, self.precision)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:  # a damaged checkpoint
            raise CheckpointError(
                f"the fine-tuning checkpoint in {self.path} cannot be read ({type(exc).__name__}: {exc}); "
                "delete it to start over"
            ) from exc


def has_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds a saved epoch (or what an older version saved there)."""
    return (ckpt / MANIFEST).is_file() or (ckpt / "state.json").is_file()


def inputs_digest(model: nn.Module, train: list[dict], val: list[dict]) -> str:
    """SHA-256 of everything besides the configuration that shapes a fine-tuning run: the starting
    weights and every train and validation batch. A checkpoint resumes only the same run."""
    return json_digest([fingerprint(model), batches_digest(train), batches_digest(val)])


def config_json(config: FineTuneConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}


def _optimizer_tensors(optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _restore(ckpt: Path, model, optimizer, config, inputs: str, precision: str) -> TrainingState:
    saved_set = load_file_set(ckpt)
    if saved_set is None:
        raise CheckpointError(
            f"checkpoint in {ckpt} was saved by an older version of hydra-ensembles; delete it to start over"
        )
    state, files = saved_set
    if state["config"] != config_json(config):  # every setting, the number of epochs included
        raise CheckpointError(
            f"checkpoint in {ckpt} was made with another configuration; delete it to start over"
        )
    if state.get("precision", precision) != precision:
        raise CheckpointError(
            f"checkpoint in {ckpt} was trained in {state['precision']}, this run computes in {precision}; "
            f"pass precision={state['precision']!r} to resume it, or delete it to start over"
        )
    if state.get("inputs_sha256") != inputs:
        raise CheckpointError(
            f"checkpoint in {ckpt} was made from other data or another starting model (or by an "
            "older release); delete it to start over"
        )
    model.load_state_dict(load_file(str(files["model.safetensors"])))
    tensors = load_file(str(files["optimizer.safetensors"]))
    per_param: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    for key, value in state["optimizer"]["scalars"].items():
        index, name = key.split(".", 1)
        per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state["optimizer"]["param_groups"]})
    result = FineTuneResult(history=state["history"], best_epoch=state["best_epoch"])
    best = state["best_nll"] if state["best_nll"] is not None else math.inf
    best_state = load_file(str(files["best.safetensors"])) if "best.safetensors" in files else None
    return TrainingState(int(state["epochs_done"]), result, best, best_state)
