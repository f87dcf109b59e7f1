"""The interface every architecture adapter implements.

An adapter knows where a model family keeps its attention blocks, their Q/K/V/O projections and
head counts, and how to swap attention modules. Everything else (pruning, ablation, fusion,
saving) is written once against this interface, so a new family is one small file.
"""

from __future__ import annotations

import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn
from torch.nn.utils import skip_init

from ..errors import InputError, UnsupportedModelError
from .running import PieceRunning, optional_submodule

Part = Literal["attention", "mlp", "norm", "classifier", "embeddings"]


@dataclass(frozen=True)
class AttentionBlock:
    """One layer's attention projections as they are now (possibly pruned)."""

    layer: int
    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    output: nn.Linear
    num_heads: int
    head_dim: int
    kv_index: tuple[int, ...] | None = None
    """Grouped-query attention: for each query head, the position of the key/value head it reads
    among ``key``'s and ``value``'s heads (``None``: every query head has its own)."""
    packed_qkv: nn.Parameter | None = None
    """Where W_Q, W_K and W_V are rows of one packed weight ([Q | K | V], ModernBERT's ``Wqkv``):
    that parameter, and ``query``, ``key``, ``value`` are copies of its rows (for reading; a
    gradient is taken of the parameter)."""

    def qkv_weights(self) -> list[tuple[nn.Parameter, slice]]:
        """W_Q, W_K and W_V as (parameter, rows of it)."""
        if self.packed_qkv is None:
            return [(linear.weight, slice(None)) for linear in (self.query, self.key, self.value)]
        width = self.query.out_features
        return [(self.packed_qkv, slice(i * width, (i + 1) * width)) for i in range(3)]

    @property
    def hidden_size(self) -> int:
        return self.query.in_features


class ZeroHeadAttention(nn.Module):
    """An attention module whose layer keeps no heads.

    It keeps the (empty) projections under the family's own attribute names so surgery code still
    finds them, and returns an empty head dimension; when ``output_name`` is given it applies that
    (0 -> d) projection itself, which leaves exactly W_O's bias, as a pruned layer must.
    """

    def __init__(self, projections: dict[str, nn.Linear], output_name: str | None = None) -> None:
        super().__init__()
        for name, module in projections.items():
            self.add_module(name, module)
        self.output_name = output_name

    def forward(self, hidden_states, *args, **kwargs):
        empty = hidden_states.new_zeros(*hidden_states.shape[:-1], 0)
        if self.output_name is not None:
            return getattr(self, self.output_name)(empty), None
        return empty, None


MIN_TRANSFORMERS = "5.18"
"""The oldest transformers release whose module layouts every adapter describes (DINOv2's
attention took ViT's ``q_proj``/``k_proj``/``v_proj``/``o_proj`` layout in 5.18)."""


def _has_all(module: nn.Module, paths: Sequence[str]) -> bool:
    return all(optional_submodule(module, path) is not None for path in paths)


class ModelLayout(ABC):
    """Where things live in one model family's modules (transformers 5.x layout): the layers,
    each layer's attention projections, the embeddings, the task head, and which fusion group
    every parameterised module belongs to. Declarative class variables, read by discovery."""

    family: ClassVar[str]
    """Human-readable family name, e.g. ``"BERT"``."""
    model_types: ClassVar[tuple[str, ...]]
    """``config.model_type`` values this adapter handles."""

    layer_lists: ClassVar[tuple[str, ...]] = (
        "encoder.layer",
        "layers",
        "transformer.layer",
        "encoder.layers",
    )
    """Where the list of layers may live under the base model (first match wins)."""

    towers: ClassVar[tuple[str, ...]] = ()
    """Attributes of task models that hold the transformer under another name than the base
    model prefix (CLIP's ``vision_model``); the first one present becomes the prefix."""

    def __init__(self, model: nn.Module) -> None:
        towers = [t for t in self.towers if isinstance(getattr(model, t, None), nn.Module)]
        self.prefix = f"{towers[0]}." if towers else _base_prefix(model)
        self.layers_path = self._find_layers(model)
        layers = self.layers(model)
        self._check_layout(model, layers)
        self._layer_count = len(layers)

    @property
    def spans(self) -> dict[str, range]:
        """The layer indices of each transformer whose heads are pruned, by its path: one span,
        every layer, for a single model; one per tower for a dual encoder (`DualEncoderAdapter`)."""
        return {"": range(self._layer_count)}

    def encoder_config(self, model: nn.Module):
        """The configuration of the transformer the adapter works on (a composite model's
        sub-configuration, e.g. CLIP's ``vision_config``)."""
        return model.config

    def _find_layers(self, model: nn.Module) -> str:
        for candidate in self.layer_lists:
            path = f"{self.prefix}{candidate}"
            try:
                found = model.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(found, nn.ModuleList):
                return path
        raise UnsupportedModelError(
            f"{type(model).__name__}: no layer list at any of {list(self.layer_lists)} "
            f"under {self.prefix or 'the model'}; is this transformers version supported?"
        )

    def _check_layout(self, model: nn.Module, layers: list[nn.Module]) -> None:
        """Refuse a model whose ``layers`` lack the attention projections this adapter names (the
        module layout of a transformers release this family's code does not describe)."""
        paths = getattr(self, "projection_paths", ())
        if not paths or not layers or any(_has_all(layer, paths) for layer in layers):
            return
        modules = (m for layer in layers for m in layer.modules())
        if any(type(m).__module__.startswith("hydra_ensembles.") for m in modules):
            return  # attention this library swapped in (fused, or every head pruned)
        import transformers

        missing = next(p for p in paths if not _has_all(layers[0], (p,)))
        raise UnsupportedModelError(
            f"{type(model).__name__}: its layers have no {missing!r}, where hydra-ensembles finds "
            f"{self.family} attention; this module layout comes from transformers "
            f"{transformers.__version__}, and the {self.family} support needs the layout of "
            f"transformers >= {MIN_TRANSFORMERS}"
        )

    # ----------------------------------------------------------------- discovery
    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) in cls.model_types

    def layers(self, model: nn.Module) -> list[nn.Module]:
        """The transformer layers, in order."""
        return list(model.get_submodule(self.layers_path))

    projection_paths: ClassVar[tuple[str, str, str, str]]
    """Paths of W_Q, W_K, W_V and W_O inside one layer."""

    def attention_dropout(self, model: nn.Module) -> float:
        """Dropout on the attention probabilities (the config names it per family)."""
        config = self.encoder_config(model)
        for name in ("attention_probs_dropout_prob", "attention_dropout"):
            value = getattr(config, name, None)
            if value is not None:
                return float(value)
        return 0.0

    def head_dim(self, model: nn.Module) -> int:
        config = self.encoder_config(model)
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def attention_block(self, model: nn.Module, layer: int) -> AttentionBlock:
        """The projections and head count of ``layer`` as the model is now."""
        block = self.layers(model)[layer]
        query, key, value, output = (block.get_submodule(p) for p in self.projection_paths)
        head_dim = self.head_dim(model)
        return AttentionBlock(layer, query, key, value, output, query.out_features // head_dim, head_dim)

    embeddings_module: ClassVar[str] = "embeddings"
    """The embeddings module under the base model (Llama's ``embed_tokens``)."""

    @property
    def embeddings_path(self) -> str:
        """Dotted path of the embeddings module (treated as one unit by fusion)."""
        return f"{self.prefix}{self.embeddings_module}"

    input_modules: ClassVar[tuple[str, ...]] = ()
    """Modules of the base model that run between the embeddings and the first layer (ELECTRA's
    ``embeddings_project``); they belong to the embeddings part."""

    @property
    def input_paths(self) -> tuple[str, ...]:
        """Dotted paths of everything computed before the first layer: embeddings first."""
        return (self.embeddings_path, *(f"{self.prefix}{name}" for name in self.input_modules))

    head_bias_tables: ClassVar[tuple[str, ...]] = ()
    """Modules of the base model holding per-head attention-score biases shared by all layers
    (one column per original head: MPNet's ``encoder.relative_attention_bias``). Like attention,
    fusion keeps them per member where members differ."""

    position_tables: ClassVar[tuple[tuple[str, str | None], ...]] = ()
    """Tables of the base model that every layer reads whole, as ``(table, norm)`` (DeBERTa's
    relative position embeddings and the LayerNorm applied to them): fusion keeps the pair per
    member (``(M, rows, width)``, `layers.MemberTable`) where members differ and the embeddings
    policy is exact, else shares or averages it."""

    @property
    def position_table_paths(self) -> tuple[tuple[str, str | None], ...]:
        return tuple(
            (f"{self.prefix}{t}", f"{self.prefix}{n}" if n else None) for t, n in self.position_tables
        )

    @property
    def head_bias_paths(self) -> tuple[str, ...]:
        return tuple(f"{self.prefix}{name}" for name in self.head_bias_tables)

    call_options: ClassVar[dict[str, object]] = {}
    """Keyword arguments the library's own forward passes add (decoders: ``use_cache=False``, a
    classifier never reuses keys and values)."""

    head_reads_inputs: ClassVar[bool] = False
    """The task head reads model inputs besides the last layer's output (a decoder's last-token
    pooling reads ``input_ids``, SigLIP 2's mean pooling ``pixel_attention_mask``): a fused model's
    shared trunk then keeps the inputs member-stacked."""

    last_token_pooling: ClassVar[bool] = False
    """The sequence classifier reads the last token that is not ``config.pad_token_id`` (decoder
    LLMs): inputs must be padded with that id."""

    head_modules: ClassVar[tuple[str, ...]] = ("classifier",)
    """Names of the task head's modules on the task model (paths that do not exist are ignored)."""

    @property
    def head_paths(self) -> tuple[str, ...]:
        """Dotted paths of the task head (the base model's pooler and the task modules)."""
        return (f"{self.prefix}pooler", *self.head_modules)

    def task_head_modules(self, model: nn.Module) -> list[str]:
        """The task modules of ``head_modules`` that ``model`` has (e.g. freshly initialised)."""
        return [name for name in self.head_modules if isinstance(getattr(model, name, None), nn.Module)]

    @abstractmethod
    def attention_paths(self, layer: int) -> tuple[str, ...]:
        """Dotted paths of the modules `install_fused_attention` replaces (for saving layouts)."""

    def attention_core_path(self, layer: int) -> str | None:
        """Dotted path of ``layer``'s module that turns hidden states into the heads' context
        (Q/K/V and attention, before W_O) and returns ``(context, weights)``; ``None`` where the
        family has no such module (ViT keeps W_O inside its attention module)."""
        return None

    def num_layers(self, model: nn.Module) -> int:
        return len(self.layers(model))

    def original_heads_per_layer(self, model: nn.Module) -> list[int]:
        """Head counts of the unpruned model (the config's)."""
        return [int(self.encoder_config(model).num_attention_heads)] * self.num_layers(model)

    def part_of(self, path: str, module: nn.Module) -> Part:
        """Which fusion policy group a parameterised module belongs to."""
        if is_under(path, self.input_paths):
            return "embeddings"
        if is_under(path, self.head_paths):
            return "classifier"
        if isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
            return "norm"
        return "mlp"


class AttentionSurgery(ABC):
    """How one family's attention is rewritten: pruned projections installed, and the fused
    attention of all members built and installed in place of a layer's attention."""

    @abstractmethod
    def set_attention(
        self,
        model: nn.Module,
        layer: int,
        query: nn.Linear,
        key: nn.Linear,
        value: nn.Linear,
        output: nn.Linear,
        num_heads: int,
        heads: Sequence[int] | None = None,
    ) -> None:
        """Install new (sliced) projections with ``num_heads`` heads; 0 heads is allowed.

        ``heads``: the original indices of the heads kept, for families whose attention takes
        per-head inputs besides Q/K/V (MPNet's relative position bias); others ignore it."""

    def fused_settings(self, model: nn.Module, layer: int) -> tuple[type[nn.Module], dict]:
        """The fused attention class of ``layer`` and its settings beyond the heads' shapes
        (`FusedMultiHeadAttention`, none: a subclass for families whose attention differs)."""
        from ..layers import FusedMultiHeadAttention

        return FusedMultiHeadAttention, {}

    def fused_attention(
        self,
        model: nn.Module,
        layer: int,
        projections: Sequence[tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]],
        heads: Sequence[Sequence[int]],
        bias_stride: int = 0,
        sources: Sequence[nn.Module] = (),
    ) -> nn.Module:
        """The module fusion installs at ``layer`` of ``model``: the members' pruned (query, key,
        value, output) linears, ``heads`` the original heads each keeps, ``sources`` the models
        they come from (`fused_settings`' class; ``bias_stride``: see `FusedMultiHeadAttention`)."""
        cls, settings = self.fused_settings(model, layer)
        dropout = self.attention_dropout(model)
        return cls.from_projections(
            projections, self.head_dim(model), dropout, heads, bias_stride, **settings
        )

    def empty_fused_attention(
        self, model: nn.Module, layer: int, heads: Sequence[Sequence[int]], bias_stride: int = 0
    ) -> nn.Module:
        """`fused_attention`'s architecture for members keeping ``heads``, weights unset (loading)."""
        cls, settings = self.fused_settings(model, layer)
        block = self.attention_block(model, layer)
        return cls(
            block.hidden_size,
            block.head_dim,
            [len(h) for h in heads],
            self.attention_dropout(model),
            heads=heads,
            bias_stride=bias_stride,
            **settings,
        )

    @abstractmethod
    def install_fused_attention(self, model: nn.Module, layer: int, fused: nn.Module) -> None:
        """Replace ``layer``'s attention with ``fused``, which applies W_O (and its bias) itself."""


class RuntimeShortcuts:
    """What running a family fast needs to know: how many rows an input becomes (inference
    chunking), the widest activation, the forward's inputs, and the shortcut where the head reads
    only the first token (circuit extraction)."""

    def first_token_only(self, model: nn.Module) -> ExitStack | None:
        """Where the model's head reads only the first token of the last layer, make that layer
        compute everything after attention's Q/K/V for the first token only (exact for the
        logits, about 3/4 of the layer saved); closing the returned stack (or leaving it as a
        context manager) undoes it. ``None``: not possible."""
        return None

    def tokens_per_input(self, model: nn.Module, inputs: dict) -> int:
        """Rows of hidden states one input becomes inside the transformer (tokens, or patches
        plus the class token), for sizing inference chunks; 1 where it cannot be told."""
        pixels = inputs.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.dim() == 3:  # already patches (SigLIP 2)
            return int(pixels.shape[1])
        patch = getattr(self.encoder_config(model), "patch_size", None)
        if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and patch:
            return (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch) + 1
        for name in ("input_ids", "inputs_embeds", "attention_mask"):
            value = inputs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return int(value.shape[1])
        return 1

    def mlp_width(self, model: nn.Module) -> int:
        """Width of the MLP's hidden activation, the widest tensor a layer computes per row."""
        config = self.encoder_config(model)
        width = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
        return int(width or 4 * config.hidden_size)

    def set_mlp_width(self, model: nn.Module, width: int) -> None:
        """Record ``width`` as the MLP's hidden width in ``model``'s configuration (after its MLPs
        were cut to it: `surgery.prune_mlp`), so that it saves and loads as any other of its class;
        UnsupportedModelError where the configuration names no width."""
        config = self.encoder_config(model)
        names = [n for n in ("intermediate_size", "hidden_dim") if getattr(config, n, None)]
        if not names:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s configuration names no MLP width (intermediate_size, "
                "hidden_dim): MLP pruning cannot record the narrower width"
            )
        setattr(config, names[0], int(width))

    def input_names(self, model: nn.Module) -> tuple[str, ...]:
        """Keyword inputs the model's forward accepts (taken from its signature)."""
        params = inspect.signature(model.forward).parameters.values()
        return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


class ArchitectureAdapter(ModelLayout, AttentionSurgery, RuntimeShortcuts, PieceRunning):
    """One model family: its layout (`ModelLayout`), how its attention is pruned and fused
    (`AttentionSurgery`), what running it fast needs (`RuntimeShortcuts`) and how it runs in
    pieces (`PieceRunning`: from one layer on, for circuit extraction). A family is one
    subclass registered in `adapters.registry.ADAPTERS` (docs/architectures.md)."""


def _base_prefix(model: nn.Module) -> str:
    """``"bert."`` for a task model wrapping its base model, ``""`` for the base model itself."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and hasattr(model, prefix) else ""


def is_under(path: str, roots: tuple[str, ...]) -> bool:
    return any(root and (path == root or path.startswith(root + ".")) for root in roots)


class WholeAttentionAdapter(ArchitectureAdapter):
    """Families whose attention module holds all four projections, W_O included, as direct
    children named by the last part of ``projection_paths`` (ViT, DistilBERT): pruning swaps
    those children, fusion replaces the whole module."""

    heads_attribute: ClassVar[str] = "num_attention_heads"
    """The attention module's attribute holding its head count."""

    @property
    def _attention_name(self) -> str:
        return self.projection_paths[0].rpartition(".")[0]

    def set_attention(self, model, layer, query, key, value, output, num_heads, heads=None) -> None:
        block = self.layers(model)[layer]
        names = [path.rpartition(".")[2] for path in self.projection_paths]
        projections = dict(zip(names, (query, key, value, output), strict=True))
        if num_heads == 0:
            block.set_submodule(self._attention_name, ZeroHeadAttention(projections, output_name=names[3]))
            return
        attention = block.get_submodule(self._attention_name)
        if isinstance(attention, ZeroHeadAttention):
            raise InputError(f"layer {layer} keeps no heads; heads cannot be added back")
        for name, module in projections.items():
            setattr(attention, name, module)
        setattr(attention, self.heads_attribute, num_heads)

    def install_fused_attention(self, model, layer, fused) -> None:
        self.layers(model)[layer].set_submodule(self._attention_name, fused)

    def attention_paths(self, layer: int) -> tuple[str, ...]:
        return (f"{self.layers_path}.{layer}.{self._attention_name}",)


def slice_linear(linear: nn.Linear, index: torch.Tensor | None, dim: int) -> nn.Linear:
    """A copy of ``linear`` keeping ``index`` of its outputs (dim 0) or inputs (dim 1)."""
    weight = linear.weight.detach()
    if index is None:
        shape = (0, weight.shape[1]) if dim == 0 else (weight.shape[0], 0)
        new_weight = weight.new_empty(shape)
    else:
        new_weight = weight.index_select(dim, index.to(weight.device)).clone()
    bias = linear.bias
    if bias is not None and dim == 0:
        bias = bias.detach()[index.to(bias.device)].clone() if index is not None else bias.new_empty(0)
    elif bias is not None:
        bias = bias.detach().clone()
    with warnings.catch_warnings():  # a 0-head layer has 0-element weights: nothing to initialise
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        out = skip_init(
            nn.Linear,
            new_weight.shape[1],
            new_weight.shape[0],
            bias=bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
    with torch.no_grad():
        out.weight.copy_(new_weight)
        if bias is not None:
            out.bias.copy_(bias)
    out.train(linear.training)
    out.weight.requires_grad_(linear.weight.requires_grad)
    return out
