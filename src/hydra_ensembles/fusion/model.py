"""`HydraModel`: M pruned members fused into one model that runs as one forward pass."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .._version import __version__
from ..adapters import ArchitectureAdapter, get_adapter
from ..batching import batch_rows, first_copy_call, repeat_call, repeat_rows, slice_rows
from ..configuration import write_hf_config
from ..errors import InputError
from ..heads import HeadSet
from ..layers import (
    FusedMultiHeadAttention,
    GroupedLayerNorm,
    GroupedLinear,
    MemberHeadBias,
    MemberTable,
    PerMemberModule,
    SwappedAttention,
)
from ..models import build_model
from ..ood.features import FeatureError, FeatureTap
from ..ood.storage import read_statistics, write_statistics
from ..outputs import EnsembleOutput
from ..runtime import CHUNK_CACHE_SHARE, balanced_piece, ensure_cpu_allocator_tuned, inference_chunk_rows
from ..saving.formats import WEIGHTS_NAME, SavedFormat, read_saved, register_saved_format, write_saved

CONFIG_NAME = "hydra_config.json"
FORMAT = "hydra-ensembles/fused"
FORMAT_VERSION = 1
REQUIRED = ("model_class", "base_config", "head_sets", "policy", "layout")
__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "FusionPolicy",
    "HydraLoadError",
    "HydraModel",
    "load_hydra",
    "save_hydra",
]


class HydraLoadError(InputError):
    """A saved Hydra model is missing, incomplete, tampered with, or from an unknown format."""


Mode = Literal["merge", "exact"]
MODES = ("merge", "exact")


@dataclass(frozen=True)
class FusionPolicy:
    """How fusion combines what members do not share, per part of the network.

    ``merge`` averages the members' parameters (the paper does this for the MLPs); ``exact`` keeps
    them per member as grouped layers, so the fused model reproduces the explicit ensemble.
    Attention is always per member. Parts whose parameters are identical across members
    (everything but attention for untrained members) are simply shared.
    """

    mlp: Mode = "merge"
    norm: Mode = "exact"
    classifier: Mode = "exact"
    embeddings: Mode = "merge"

    @classmethod
    def create(
        cls,
        mlp: str = "merge",
        norms: str | None = None,
        classifier: str | None = None,
        embeddings: str | None = None,
    ) -> FusionPolicy:
        """``mlp="exact"`` makes every unset part exact; ``mlp="merge"`` keeps the defaults."""
        values = {"mlp": mlp, "norm": norms, "classifier": classifier, "embeddings": embeddings}
        for name, value in values.items():
            if value is not None and value not in MODES:
                raise InputError(f"{name} must be one of {MODES}, got {value!r}")
        if mlp == "exact":
            return cls(**{k: v or "exact" for k, v in values.items()})
        return cls(**{k: v for k, v in values.items() if v is not None})

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, str]) -> FusionPolicy:
        """A saved policy (models saved before the task head's part was named ``classifier``
        record it as ``head``)."""
        saved = dict(saved)
        if "head" in saved:
            saved["classifier"] = saved.pop("head")
        return cls(**saved)


class HydraModel(nn.Module):
    """A base model whose attention modules were swapped for fused ones (see `fuse`).

    Inputs are the base model's inputs; they are stacked M times internally (rows
    ``m*B .. (m+1)*B-1`` belong to member m), so the Hugging Face modelling code runs everything
    but attention unchanged. Device and dtype follow the module (``.to``, ``.cuda``, ``.bfloat16``).

    Inference (no autograd) on a CPU runs the batch in chunks of whole inputs whose member-stacked
    activations stay cache-sized (`runtime.inference_chunk_rows`): M times one model's rows
    otherwise stream every op from memory. Rows are independent, so chunking changes no result.
    ``chunk_rows`` overrides the token rows per chunk (``None``: never chunk; ``"auto"``: sized
    by the machine's cache, the default). The first CPU forward also applies the bounded
    allocator setting of `runtime.ensure_cpu_allocator_tuned` (``HYDRA_TUNE_ALLOCATOR=0``: not).
    The output carries the members' features (`ood.features`) unless ``record_features`` is False.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: ArchitectureAdapter,
        head_sets: Sequence[HeadSet],
        policy: FusionPolicy,
        layout: Sequence[dict[str, Any]] = (),
        trunk_layers: int = 0,
    ) -> None:
        super().__init__()
        self.model = model
        self.adapter = adapter
        self.head_sets = tuple(head_sets)
        self.policy = policy
        self.layout = tuple(dict(entry) for entry in layout)
        self.trunk_layers = int(trunk_layers)
        self._accepted = frozenset(adapter.input_names(model))
        self._batch: int | None = None
        self.chunk_rows: int | Literal["auto"] | None = "auto"
        self.record_features = True
        self.record_layers = False  # each member's pooled token after every layer (`FeatureTap`)
        # where the head reads the inputs (a pooling by input ids or a patch mask), the inputs stay
        # member-stacked and the trunk runs on member 0's copy of them
        self._stacked_trunk = self.trunk_layers > 0 and adapter.head_reads_inputs
        if self.trunk_layers:
            layers = adapter.layers(model)
            if self._stacked_trunk:
                for layer in layers[: self.trunk_layers]:
                    layer.register_forward_pre_hook(self._to_trunk, with_kwargs=True)
            for layer in layers[self.trunk_layers :]:
                layer.register_forward_pre_hook(self._fan_out, with_kwargs=True)
        try:  # the tap's hooks registered now: a compiled forward pass then registers none
            self._feature_tap: FeatureTap | None = FeatureTap(model, self.num_members, persistent=True)
        except FeatureError:  # no single output layer giving the logits (a base model, DeiT)
            self._feature_tap = None

    def _fan_out(self, _module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """After the shared trunk: repeat every batch-shaped layer input M times (hidden states
        once, at the first member-specific layer; the attention mask at every layer)."""
        return repeat_call(args, kwargs, self.num_members, self._batch)

    def _to_trunk(self, _module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """In the shared trunk of member-stacked inputs: member 0's rows only."""
        return first_copy_call(args, kwargs, self.num_members, self._batch)

    @property
    def num_members(self) -> int:
        return len(self.head_sets)

    @property
    def config(self):
        """The base model's configuration."""
        return self.model.config

    def fused_attention(self) -> list[FusedMultiHeadAttention | SwappedAttention]:
        return [m for m in self.model.modules() if isinstance(m, (FusedMultiHeadAttention, SwappedAttention))]

    def num_parameters(self, effective: bool = True) -> int:
        """Parameter count; ``effective`` leaves out the zero padding of ragged head counts."""
        total = sum(p.numel() for p in self.parameters())
        if effective:
            for attention in self.fused_attention():
                padded = sum(p.numel() for p in attention.parameters())
                total += attention.num_effective_parameters() - padded
        return total

    def batch_size(self, inputs: dict[str, Any]) -> int:
        """Check input names and return the batch size (dim 0 of the first tensor input)."""
        unknown = sorted(set(inputs) - self._accepted)
        if unknown:
            raise TypeError(
                f"unexpected input(s) {unknown} for a fused {self.adapter.family} model; "
                f"accepted: {sorted(self._accepted)}"
            )
        if not any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in inputs.values()):
            raise InputError(f"no tensor inputs given; accepted: {sorted(self._accepted)}")
        return batch_rows(inputs)

    def stack_inputs(self, inputs: dict[str, Any], batch: int) -> dict[str, Any]:
        """Repeat every batch-shaped tensor M times along dim 0 (the member-stacked batch)."""
        return repeat_rows(inputs, self.num_members, batch)

    def inputs_per_chunk(self, inputs: dict[str, Any], batch: int) -> int:
        """How many inputs one forward chunk takes (``batch``: no chunking); chunks are balanced
        (8 inputs in two chunks of 4, not 5 + 3). Training and compiled code run the whole batch
        (the compiler fuses the element-wise work whose activations chunks keep in cache, and
        sizing chunks reads the machine, which it cannot trace)."""
        chunked = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        rows = self.chunk_token_rows() if chunked else None
        if rows is None:
            return batch
        tokens = self.adapter.tokens_per_input(self.model, inputs)
        return balanced_piece(batch, rows // (self.num_members * tokens))

    def chunk_token_rows(self, device: Any = None, share: float = CHUNK_CACHE_SHARE) -> int | None:
        """Token rows of the member-stacked batch one inference chunk holds (`chunk_rows`, its
        ``"auto"`` sized to a ``share`` of the cache (PyTorch's by default) by
        `runtime.inference_chunk_rows` for the weights' format on ``device``, default the
        weights'); None: no chunking."""
        if self.chunk_rows != "auto":
            return None if self.chunk_rows is None else int(self.chunk_rows)
        weight = next(self.model.parameters())
        width = self.adapter.mlp_width(self.model)
        where = weight.device if device is None else device
        return inference_chunk_rows(width, weight.element_size(), where, share)

    def feature_tap(self) -> FeatureTap | None:
        """What records the members' features in a forward pass (`ood.features`), or None."""
        return self._feature_tap

    def _member_outputs(self, inputs: dict[str, Any], batch: int) -> dict[str, torch.Tensor]:
        """Every batch-shaped output of the model on ``inputs``, as (M, batch, ...), and the
        members' features as ``member_features``."""
        self._batch = batch
        inputs = {**self.adapter.call_options, **inputs}
        tap = self.feature_tap() if self.record_features else None
        if tap is not None:  # the tap's hooks stay registered (compiled code registers none)
            tap.every_layer = self.record_layers
            tap.start()
        try:
            if self.trunk_layers and not self._stacked_trunk:  # the trunk runs once on B rows; hooks fan out
                output = self.model(**inputs)
            else:
                output = self.model(**self.stack_inputs(inputs, batch))
        finally:
            if tap is not None:
                tap.stop()
        m = self.num_members
        outputs = {}
        for name in output.keys():  # noqa: SIM118 (torch.compile cannot iterate a ModelOutput's items)
            value = output[name]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == m * batch:
                outputs[name] = value.view(m, batch, *value.shape[1:])
        if tap is not None and "logits" in outputs:
            outputs["member_features"] = tap.features(inputs, batch)
            if self.record_layers:
                outputs["layer_features"] = tap.layer_features(inputs, batch)
        return outputs

    def forward(self, **inputs: Any) -> EnsembleOutput:
        labels = inputs.pop("labels", None)
        batch = self.batch_size(inputs)
        if next(self.model.parameters()).device.type == "cpu" and not torch.compiler.is_compiling():
            ensure_cpu_allocator_tuned()  # once per process, before the first pass (not traceable)
        per = self.inputs_per_chunk(inputs, batch)
        if per >= batch:
            members = self._member_outputs(inputs, batch)
        else:
            parts = [
                self._member_outputs(slice_rows(inputs, start, start + per, batch), min(per, batch - start))
                for start in range(0, batch, per)
            ]
            members = {name: torch.cat([part[name] for part in parts], 1) for name in parts[0]}
        member_logits = members.pop("logits", None)
        features = members.pop("member_features", None)
        layer_features = members.pop("layer_features", None)
        if member_logits is None:
            if labels is not None:
                raise InputError("labels were given but the model produces no logits")
            return EnsembleOutput(members=members)
        return EnsembleOutput.from_member_logits(
            member_logits, labels, features, layer_features, logits=member_logits, **members
        )

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write ``hydra_config.json`` and ``model.safetensors`` (atomically) to ``path``, then the
        ``config.json`` that routes ``transformers``' Auto classes and ``pipeline`` to it."""
        return _save_hydra(self, path)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device | None = None) -> HydraModel:
        """Load a model written by `save_pretrained` (`load_hydra`)."""
        return load_hydra(path, device)

    def extra_repr(self) -> str:
        policy = self.policy.to_dict()
        return f"num_members={self.num_members}, trunk_layers={self.trunk_layers}, policy={policy}"


def load_hydra(path: str | os.PathLike, device: str | torch.device | None = None) -> HydraModel:
    """Load a model written by `save_pretrained`: the architecture is rebuilt from the JSON
    config (a transformers class of a supported family, the members' head sets, the grouped
    layout) and filled from safetensors; outputs are bitwise identical."""
    config, state = read_saved(
        path, CONFIG_NAME, FORMAT, (FORMAT_VERSION,), REQUIRED, HydraLoadError, "Hydra model", device
    )
    try:
        model = build_model(config["model_class"], config["base_config"], config.get("attn_implementation"))
    except ValueError as exc:
        raise HydraLoadError(str(exc)) from exc
    adapter = get_adapter(model)
    head_sets = [HeadSet.from_dict(hs) for hs in config["head_sets"]]
    trunk = int(config.get("trunk_layers", 0))
    _install_empty_fused(model, adapter, head_sets, config["layout"], trunk)
    if config.get("dtype"):
        model.to(getattr(torch, config["dtype"]))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise HydraLoadError(f"weights in {path} do not fit {CONFIG_NAME}: {exc}") from exc
    model.to(device or "cpu").eval()
    policy = FusionPolicy.from_dict(config["policy"])
    hydra = HydraModel(model, adapter, head_sets, policy, config["layout"], trunk_layers=trunk)
    read_statistics(hydra, path, HydraLoadError)
    return hydra


def save_hydra(hydra: HydraModel, path: str | os.PathLike) -> Path:
    """`HydraModel.save_pretrained` as a function."""
    return hydra.save_pretrained(path)


_GROUPED = (GroupedLinear, GroupedLayerNorm, PerMemberModule, MemberHeadBias, MemberTable)
LAYOUT_MODULES: dict[str, Any] = {cls.layout_kind: cls for cls in _GROUPED}
"""The member-grouped modules a saved model's ``layout`` names, by their ``layout_kind``; each
rebuilds itself empty (``empty_like``) for the weights to fill."""


def layout_entry(path: str, module: nn.Module) -> dict[str, str]:
    """The ``layout`` record of the grouped ``module`` that fusion put at ``path``."""
    return {"path": path, "kind": type(module).layout_kind}


def member_bias_stride(layout: Sequence[dict[str, Any]], original_heads: Sequence[int]) -> int:
    """Channels per member of the attention-score biases when members keep their own bias tables
    (`MemberHeadBias` in ``layout``), else 0 (one shared table)."""
    return max(original_heads) if any(e["kind"] == MemberHeadBias.layout_kind for e in layout) else 0


def _install_empty_fused(
    model: nn.Module, adapter: ArchitectureAdapter, head_sets: list[HeadSet], layout, trunk: int
) -> None:
    """Give ``model`` the fused architecture a saved Hydra model describes (weights unset)."""
    original = adapter.original_heads_per_layer(model)
    resolved = [hs.resolve(original) for hs in head_sets]
    stride = member_bias_stride(layout, original)
    for layer in range(len(original)):
        heads = [r[layer] for r in resolved[: 1 if layer < trunk else len(resolved)]]
        adapter.install_fused_attention(
            model, layer, adapter.empty_fused_attention(model, layer, heads, stride)
        )
    for entry in layout:
        model.set_submodule(entry["path"], _empty_grouped(model, entry, len(head_sets)))


def _empty_grouped(model: nn.Module, entry: dict[str, Any], num_members: int) -> nn.Module:
    grouped = LAYOUT_MODULES.get(entry["kind"])
    if grouped is None:
        raise HydraLoadError(f"unknown layout kind {entry['kind']!r} at {entry['path']!r}")
    return grouped.empty_like(model.get_submodule(entry["path"]), num_members)


def _save_hydra(model: HydraModel, path: str | os.PathLike) -> Path:
    """`HydraModel.save_pretrained`: the statistics, the weights and ``hydra_config.json``, then
    the Hugging Face ``config.json`` (last: a folder without it is unfinished)."""
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.model.parameters()}
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "model_class": type(model.model).__name__,
        "base_config": model.model.config.to_dict(),
        "attn_implementation": getattr(model.model.config, "_attn_implementation", None),
        "dtype": dtypes.pop() if len(dtypes) == 1 else None,
        "head_sets": [hs.to_dict() for hs in model.head_sets],
        "policy": model.policy.to_dict(),
        "layout": list(model.layout),
        "trunk_layers": model.trunk_layers,
    }
    write_statistics(model, path)  # before the config, whose checksums then cover it
    saved = write_saved(path, CONFIG_NAME, config, model.model.state_dict())
    write_hf_config(saved, model.model.config, "fused")
    return saved


register_saved_format(SavedFormat("fused", CONFIG_NAME, load_hydra, model_class=HydraModel, save=_save_hydra))
