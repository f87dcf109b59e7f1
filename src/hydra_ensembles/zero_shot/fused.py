"""`ZeroShotHydra`: M pruned dual-encoder members fused into one zero-shot model.

The input tower is fused as for any model (`fusion.fuse`: one member-stacked forward pass, exact
for untrained members, who share every weight but attention). The label tower runs once per
member when the model is built: each member's class embeddings are cached, so pruning the label
tower costs nothing at inference. Member logits are ``logit_scale`` x cosine between member m's
input embedding and member m's class embeddings; the prediction is the mean of member softmaxes.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..adapters import get_adapter
from ..errors import InputError
from ..fusion import HydraModel, fuse
from ..heads import HeadSet
from ..ood.storage import read_statistics, write_statistics
from ..outputs import EnsembleOutput
from ..progress import progress_bar
from ..saving.formats import SavedFormat, read_saved, register_saved_format, write_saved
from ..saving.metadata import read_metadata, split_metadata, write_metadata
from ..surgery import forget_calibration, kept_heads, prune
from .model import DualEncoderClassifier, DualEncoderConfig
from .towers import EncoderTower, cosine_logits, normalize, pool

CONFIG_NAME = "zero_shot_config.json"
FORMAT = "hydra-ensembles/zero-shot"
FORMAT_VERSION = 1
INPUT_TOWER_DIR = "input_tower"


class ZeroShotLoadError(InputError):
    """A saved zero-shot Hydra model is missing, incomplete, tampered with or unknown."""


class ZeroShotHydra(nn.Module):
    """Fused input tower (`HydraModel`) + per-member cached class embeddings (M, C, D)."""

    def __init__(
        self,
        input_hydra: HydraModel,
        class_embeddings: torch.Tensor,
        config: DualEncoderConfig,
        head_sets: Sequence[HeadSet],
    ) -> None:
        super().__init__()
        if class_embeddings.dim() != 3 or class_embeddings.shape[0] != input_hydra.num_members:
            shape = tuple(class_embeddings.shape)
            raise InputError(f"class embeddings must be (M={input_hydra.num_members}, C, D), got {shape}")
        self.input_hydra = input_hydra
        self.register_buffer("class_embeddings", class_embeddings)
        self.config = config
        self.head_sets = tuple(head_sets)

    @property
    def num_members(self) -> int:
        return self.input_hydra.num_members

    def num_parameters(self, effective: bool = True) -> int:
        """Parameters of the fused input tower (the label tower is not part of the model: its
        output is the cached class embeddings, a buffer)."""
        return self.input_hydra.num_parameters(effective)

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> EnsembleOutput:
        members = self.input_hydra(**inputs).members  # (M, B, ...) per output
        embeddings = pool(members, inputs, self.config.input_pooling)  # (M, B, D)
        logits = cosine_logits(
            embeddings, self.class_embeddings, self.config.logit_scale, self.config.logit_bias
        )
        return EnsembleOutput.from_member_logits(logits, labels, normalize(embeddings))

    @torch.no_grad()
    def output_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each member's affine map from its unit input embedding (its feature) to its logits,
        ``(W (M, C, D), b (M, C))`` in float64: ``logit_scale`` x its class embeddings, ``logit_bias``."""
        weight = self.config.logit_scale * self.class_embeddings.double()
        return weight, torch.full(weight.shape[:2], float(self.config.logit_bias), dtype=torch.float64)

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """The fused input tower in ``input_tower/`` (a Hydra save), then the class embeddings and
        this config (classes, templates, scale, poolings, head sets, calibration), checksummed,
        written last."""
        path = Path(path)
        self.input_hydra.save_pretrained(path / INPUT_TOWER_DIR)
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "dual_encoder": split_metadata(self.config.to_dict())[1],
            "head_sets": [hs.to_dict() for hs in self.head_sets],
            "calibration": read_metadata(self).calibration,
        }
        write_statistics(self, path)  # before the config, whose checksums then cover it
        return write_saved(path, CONFIG_NAME, config, {"class_embeddings": self.class_embeddings})

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: str | torch.device | None = None
    ) -> ZeroShotHydra:
        required = ("dual_encoder", "head_sets")
        config, state = read_saved(
            path,
            CONFIG_NAME,
            FORMAT,
            (FORMAT_VERSION,),
            required,
            ZeroShotLoadError,
            "zero-shot Hydra",
            device,
        )
        try:
            dual = DualEncoderConfig(**config["dual_encoder"])
        except (TypeError, ValueError) as exc:
            raise ZeroShotLoadError(f"{path}: bad dual-encoder config: {exc}") from exc
        if set(state) != {"class_embeddings"}:
            raise ZeroShotLoadError(f"{path}: expected only class_embeddings, found {sorted(state)}")
        hydra = HydraModel.from_pretrained(Path(path) / INPUT_TOWER_DIR, device)
        head_sets = [HeadSet.from_dict(hs) for hs in config["head_sets"]]
        try:
            model = cls(hydra, state["class_embeddings"], dual, head_sets)
        except ValueError as exc:
            raise ZeroShotLoadError(f"{path}: {exc}") from exc
        write_metadata(model, calibration=config.get("calibration"))  # `calibration.calibrate`'s record
        read_statistics(model, path, ZeroShotLoadError)
        return model.to(device or "cpu").eval()

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}, classes={self.config.classes}"


def split_head_set(model: DualEncoderClassifier, heads: HeadSet) -> tuple[HeadSet, HeadSet | None]:
    """A joint head set as (input tower heads, label tower heads or None when not pruned)."""
    adapter = get_adapter(model)
    resolved = heads.resolve(adapter.original_heads_per_layer(model))
    parts = [
        HeadSet({layer - span.start: resolved[layer] for layer in span}) for span in adapter.spans.values()
    ]
    return parts[0], (parts[1] if len(parts) > 1 else None)


@torch.no_grad()
def member_class_embeddings(model: DualEncoderClassifier, label_heads: HeadSet | None) -> torch.Tensor:
    """(C, D) class embeddings of a member whose label tower keeps ``label_heads``."""
    if label_heads is None:
        was_training = model.training
        try:
            return model.eval().class_embeddings().detach().clone()
        finally:
            model.train(was_training)
    # eval mode: class embeddings are computed once, without dropout, whatever mode the model is in
    tower = EncoderTower(prune(model.label_tower.model, label_heads), model.label_tower.pooling).eval()
    return model.class_embeddings_from(tower(**model.prompt_inputs))


def fuse_dual_encoder(
    model: DualEncoderClassifier,
    head_sets: Sequence[HeadSet],
    shared_trunk: bool = True,
    progress: bool = False,
) -> ZeroShotHydra:
    """One `ZeroShotHydra` from an unpruned dual encoder and one joint head set per member
    (heads of both towers, or of the input tower, as ``model.config.heads`` says)."""
    if not getattr(model, "is_dual_encoder", False):
        raise TypeError(f"fuse_dual_encoder needs a DualEncoderClassifier, got {type(model).__name__}")
    head_sets = list(head_sets)
    if not head_sets:
        raise InputError("cannot fuse zero members (M = 0); give at least one head set")
    original = get_adapter(model).original_heads_per_layer(model)
    if kept_heads(model).resolve(original) != HeadSet.full(original).resolve(original):
        raise InputError("fuse_dual_encoder needs an unpruned dual encoder")
    parts = [split_head_set(model, hs) for hs in head_sets]
    hydra = fuse(model.input_tower.model, [p[0] for p in parts], shared_trunk=shared_trunk)
    classes = [
        member_class_embeddings(model, label)
        for _, label in progress_bar(parts, desc="class embeddings", leave=False, enabled=progress)
    ]
    resolved = [HeadSet(dict(enumerate(hs.resolve(original)))) for hs in head_sets]
    # its own config, so that a calibration fit for it is its alone
    fused = ZeroShotHydra(hydra, torch.stack(classes), copy.deepcopy(model.config), resolved).eval()
    forget_calibration(fused)
    return fused


register_saved_format(
    SavedFormat(
        "zero-shot",
        CONFIG_NAME,
        ZeroShotHydra.from_pretrained,
        classifier=False,
        model_class=ZeroShotHydra,
        save=ZeroShotHydra.save_pretrained,
    )
)
