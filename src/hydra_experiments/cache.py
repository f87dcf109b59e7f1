"""The demo's caches: trained models and rankings keyed by what they depend on, predictions keyed
by the model's weights; stage timing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from hydra_ensembles.evaluation import (
    Predictions,
    predict,
)
from hydra_ensembles.hashing import batches_digest, json_digest, module_fingerprint, text_digest
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.members.ensemble import DeepEnsemble
from hydra_ensembles.saving.files import atomic_write, atomic_write_json


class PredictionCache:
    """`predict` that computes each (model, split, precision) once: the deep ensemble's first member
    is the Single model, and the pruning curves start from the unpruned base. An explicit ensemble
    (a list or a `DeepEnsemble`) is predicted member by member, so shared members are shared. MC
    dropout (random) is never reused. Models are held, so their ids cannot be reused while the
    cache lives.

    With a ``root`` folder, predictions also persist there (safetensors, written atomically), keyed
    by a fingerprint of the model (its type, structure and every parameter and buffer), the inputs
    and the precision: a rerun or an interrupted long run resumes without predicting again, and a
    changed model or input is never served old predictions.

    Every prediction records each member's pooled token after every layer where the model can
    (`predict`'s ``layers``), so that ``mds_layers`` is measured for every method that has them."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = None if root is None else Path(root)
        self._known: dict[tuple, tuple[torch.nn.Module, Predictions]] = {}
        self._fingerprints: dict[int, str] = {}

    def predict(
        self, model, batches, split: str, mc_samples: int = 0, precision: str = "auto", progress=True
    ) -> Predictions:
        if isinstance(model, DeepEnsemble):
            model = list(model.members)
        if isinstance(model, list):
            parts = [self.predict(m, batches, split, mc_samples, precision, progress) for m in model]
            features = [p.member_features for p in parts]
            layers = [p.layer_features for p in parts]
            return Predictions(
                np.concatenate([p.member_logits for p in parts]),
                parts[0].labels,
                None if any(f is None for f in features) else np.concatenate(features),
                None if any(f is None for f in layers) else np.concatenate(layers),
            )
        if mc_samples:
            return predict(
                model, batches, split, progress=progress, mc_samples=mc_samples, precision=precision
            )
        key = (id(model), split, precision)
        if key not in self._known:
            self._known[key] = (model, self._stored(model, batches, split, precision, progress))
        return self._known[key][1]

    def _stored(self, model, batches, split: str, precision: str, progress: bool) -> Predictions:
        if self.root is None:
            return predict(model, batches, split, progress=progress, precision=precision, layers=True)
        batches = list(batches)
        # "features", "layers": predictions hold the members' features and their every layer's
        # pooled token (older stored ones did not)
        key = f"{self._fingerprint(model)}|{batches_digest(batches)}|{precision}|features|layers"
        digest = text_digest(key)[:24]
        path = self.root / f"{digest}.safetensors"
        if path.is_file():
            stored = {k: v.numpy() for k, v in load_file(str(path)).items()}
            return Predictions(
                stored["member_logits"],
                stored.get("labels"),
                stored.get("member_features"),
                stored.get("layer_features"),
            )
        found = predict(model, batches, split, progress=progress, precision=precision, layers=True)
        arrays = {
            "member_logits": found.member_logits,
            "labels": found.labels,
            "member_features": found.member_features,
            "layer_features": found.layer_features,
        }
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items() if v is not None}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"split": split}))
        return found

    def _fingerprint(self, model: torch.nn.Module) -> str:
        if id(model) not in self._fingerprints:
            self._fingerprints[id(model)] = module_fingerprint(model)
        return self._fingerprints[id(model)]


class Stage:
    """Prints what runs and how long it took."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        print(f"[{time.perf_counter() - self.start:6.1f}s] {name} ...", flush=True)
        value = fn()
        self.timings[name] = time.perf_counter() - t
        return value

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class Cache:
    """Models and JSON artefacts under ``root/<kind>-<hash of key>``. ``built`` lists the entries
    this instance computed rather than read (what a second run should not have to compute)."""

    def __init__(self, root: Path, enabled: bool) -> None:
        self.root, self.enabled = Path(root), enabled
        self.built: list[str] = []

    def path(self, kind: str, key: dict[str, Any]) -> Path:
        digest = json_digest(key)[:16]
        return self.root / f"{kind}-{digest}"

    def model(self, kind: str, key: dict[str, Any], build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        where = self.path(kind, key)
        if self.enabled and (where / "member_config.json").is_file():
            return load_member(where)
        model = build()
        self.built.append(where.name)
        save_member(model, where)
        return model

    def json(self, kind: str, key: dict[str, Any], build: Callable[[], Any]) -> Any:
        where = self.path(kind, key) / "value.json"
        if self.enabled and where.is_file():
            return json.loads(where.read_text())
        value = build()
        self.built.append(where.parent.name)
        atomic_write_json(where, value)
        return value

    def predictions(self) -> PredictionCache:
        """A `PredictionCache` persisting under ``root/predictions`` (in memory only if disabled)."""
        return PredictionCache(self.root / "predictions" if self.enabled else None)
