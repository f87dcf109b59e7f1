"""The features each member's classifier reads, recorded in the forward pass the model makes.

A member's *feature* is the input of its task head's output layer (the affine map whose outputs
are the logits): BERT's pooled output, RoBERTa's and MPNet's dense-and-tanh of [CLS], DistilBERT's
``pre_classifier`` output, a ViT's or DeiT's class token, DINOv2's [CLS, mean patch] pair,
SigLIP's pooled patches, a decoder classifier's last real token. Feature-space OOD scores
(`ood.detectors`) read these, and ViM also reads the output layer's weights (`member_heads`).

`FeatureTap` records the features during a forward call with a forward hook on that layer and
returns them as ``(M, B, D)``, whatever the kind of ensemble: one module answering for M members
in member-stacked rows (a fused Hydra model, a BatchEnsemble), side by side in channels (a
Packed-Ensemble), from one shared feature (MIMO, an ensemble of heads on one backbone), or M calls
of one model (MC dropout, a deep ensemble's members run one by one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..adapters import get_adapter
from ..adapters.base import is_under
from ..errors import InputError
from ..layers import BatchEnsembleLinear, GroupedLinear, PackedLinear

__all__ = ["FeatureError", "FeatureTap", "ensemble_heads", "logits_layers", "member_heads"]

_AFFINE = (nn.Linear, GroupedLinear, BatchEnsembleLinear, PackedLinear)


class FeatureError(InputError):
    """A model whose logits are not one affine map of one feature vector per member."""


def _out_width(module: nn.Module) -> int:
    """Outputs per input row of an affine layer (all members' for a packed layer)."""
    return int(module.out_features)


def logits_layers(model: nn.Module, num_members: int = 1) -> list[nn.Module]:
    """The task head's output layer of ``model`` (a Hugging Face classifier, possibly pruned,
    fused, a BatchEnsemble, Packed-Ensemble or MIMO model), or one per head of an ensemble of
    heads: the last affine layer of the head giving ``num_labels`` (or M * ``num_labels``)
    outputs. FeatureError where there is none, or where two heads' outputs are averaged."""
    config = model.config
    classes = int(config.num_labels)
    adapter = get_adapter(model)
    heads = [
        (path, module)
        for path, module in model.named_modules()
        if path and is_under(path, adapter.head_paths) and type(module).__name__ == "MemberHeads"
    ]
    if heads:  # an ensemble of task heads: the last of them holds the output layers
        _, last = heads[-1]
        return [_last_affine(head, classes, num_members, type(model).__name__) for head in last.heads]
    found: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        outputs = isinstance(module, _AFFINE) and _out_width(module) in (classes, num_members * classes)
        if outputs and is_under(path, adapter.head_paths):
            found[path.split(".")[0]] = module  # the last such layer of each head module
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(found)})"
        raise FeatureError(
            f"{type(model).__name__} has {what} task-head output layers giving {classes} logits: feature "
            "scores need the logits to be one affine map of one feature vector"
        )
    return list(found.values())


def _last_affine(head: nn.Module, classes: int, members: int, owner: str) -> nn.Module:
    layers = [m for m in head.modules() if isinstance(m, _AFFINE) and _out_width(m) == classes]
    if not layers:
        raise FeatureError(f"a task head of {owner} has no output layer giving {classes} logits")
    return layers[-1]


class FeatureTap:
    """Record the features of ``model``'s members while it runs (see the module docstring).

    ``with FeatureTap(model, M) as tap: model(**inputs)``, then ``tap.features(inputs, batch)``
    gives ``(M, batch, D)``. Only what the output layer already received is kept: recording adds
    no computation to the forward pass (a decoder's last token is gathered afterwards)."""

    def __init__(
        self,
        model: nn.Module,
        num_members: int = 1,
        layers: Sequence[nn.Module] | None = None,
        persistent: bool = False,
    ):
        """``persistent``: the hooks are registered once, now, and record only inside ``with``
        (a model that keeps its tap: no hook is registered during a forward pass, which
        ``torch.compile`` cannot trace); otherwise each ``with`` registers and removes them.
        ``every_layer`` (an attribute, off by default): also record the pooled token after each
        transformer layer (`layer_features`)."""
        self.model, self.num_members = model, int(num_members)
        self.layers = list(layers) if layers is not None else logits_layers(model, self.num_members)
        adapter = get_adapter(model)
        self.blocks, self._whole_sequence = adapter.layers(model), adapter.last_token_pooling
        self.calls: list[tuple[nn.Module, torch.Tensor]] = []
        self.block_calls: list[torch.Tensor] = []
        self.every_layer = False
        self._handles: list[Any] = []
        self.persistent, self._active = persistent, False
        if persistent:
            self._register()

    def _register(self) -> None:
        for layer in self.layers:
            self._handles.append(layer.register_forward_hook(self._record))
        for block in self.blocks:
            self._handles.append(block.register_forward_hook(self._record_block))

    def start(self) -> None:
        """Record from now on (what ``with`` does on entering)."""
        self.calls.clear()
        self.block_calls.clear()
        self._active = True
        if not self.persistent:
            self._register()

    def stop(self) -> None:
        """Stop recording (what ``with`` does on leaving); the recorded calls stay."""
        self._active = False
        if self.persistent:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> FeatureTap:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _record(self, module: nn.Module, args: tuple, _output: Any) -> None:
        if self._active:
            self.calls.append((module, args[0].detach()))

    def _record_block(self, _module: nn.Module, _args: tuple, output: Any) -> None:
        if self._active and self.every_layer:
            hidden = output[0] if isinstance(output, tuple) else output
            # a decoder's pooled token is found from the inputs afterwards; others read token 0
            self.block_calls.append(hidden.detach() if self._whole_sequence else hidden[:, 0].detach())

    def layer_features(self, inputs: dict[str, Any], batch: int) -> torch.Tensor:
        """The pooled token after each recorded layer as ``(M, batch, L, D_h)`` (cleared
        afterwards): member-stacked rows are split by member, rows of a layer all members share
        (a fused model's trunk; one model) are every member's. FeatureError where the layers did
        not run or their rows are neither."""
        calls, self.block_calls = self.block_calls, []
        if len(calls) != len(self.blocks):
            raise FeatureError(f"{len(calls)} layer outputs recorded for {len(self.blocks)} layers")
        members, views = self.num_members, []
        for hidden in calls:
            hidden = self._pooled(hidden, inputs, batch)  # a decoder's every token: its last real one
            if hidden.shape[0] == members * batch:
                views.append(hidden.reshape(members, batch, -1))
            elif hidden.shape[0] == batch:
                views.append(hidden.unsqueeze(0).expand(members, *hidden.shape))
            else:
                raise FeatureError(
                    f"a layer gave {hidden.shape[0]} rows for {members} members of {batch} inputs"
                )
        return torch.stack(views, 2)

    def features(self, inputs: dict[str, Any], batch: int) -> torch.Tensor:
        """The recorded calls' features as ``(M, batch, D)`` (cleared afterwards)."""
        calls, self.calls = self.calls, []
        if not calls:
            raise FeatureError(f"{type(self.model).__name__}'s output layer did not run")
        members = self.num_members
        pooled = [(module, self._pooled(x, inputs, batch)) for module, x in calls]
        if len(pooled) == members and all(x.shape[0] == batch for _, x in pooled):
            return torch.stack([x for _, x in pooled])  # one call per member
        if len(pooled) != 1:
            raise FeatureError(f"{len(pooled)} calls of the output layer for {members} members")
        module, x = pooled[0]
        if x.shape[0] == members * batch:  # member-stacked rows
            return x.reshape(members, batch, x.shape[-1])
        if x.shape[0] != batch:
            raise FeatureError(f"the output layer read {x.shape[0]} rows for a batch of {batch}")
        if isinstance(module, PackedLinear) and module.groups == members:  # members in the channels
            split = x.reshape(batch, module.chunks, members, -1).permute(2, 0, 1, 3)
            return split.reshape(members, batch, -1)  # member m: its block of every chunk
        return x.unsqueeze(0).expand(members, *x.shape)  # one feature read by every member's head

    def _pooled(self, x: torch.Tensor, inputs: dict[str, Any], batch: int) -> torch.Tensor:
        """Row features: a decoder's score layer reads every token, of which its last real token
        (the last that is not ``config.pad_token_id``, as Hugging Face pools) is the input's."""
        if x.dim() == 2:
            return x
        if x.dim() != 3 or not get_adapter(self.model).last_token_pooling:
            raise FeatureError(f"the output layer read a {tuple(x.shape)} tensor, not one vector per input")
        last = last_token_index(self.model.config, inputs.get("input_ids"), x.shape[1])
        if x.shape[0] != last.shape[0]:
            last = last.repeat(x.shape[0] // last.shape[0])
        return x[torch.arange(x.shape[0], device=x.device), last.to(x.device)]


def last_token_index(config: Any, input_ids: torch.Tensor | None, length: int) -> torch.Tensor:
    """Per input, the position Hugging Face's sequence classifiers pool: the rightmost token that
    is not ``pad_token_id`` (the last position without a padding id or without ``input_ids``)."""
    pad = config.get_text_config().pad_token_id if hasattr(config, "get_text_config") else config.pad_token_id
    if input_ids is None or pad is None:
        rows = 1 if input_ids is None else input_ids.shape[0]
        return torch.full((rows,), length - 1, dtype=torch.long)
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad)).argmax(-1)


def ensemble_heads(ensemble: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`member_heads` of an ensemble as `members.as_ensemble` makes it (a fused Hydra model, a
    deep ensemble, MC dropout, a model answering for M members), or None where its logits are not
    one affine map of one feature vector per member."""
    members = int(ensemble.num_members)
    if hasattr(ensemble, "output_head"):  # a zero-shot Hydra model: its cosine heads
        return ensemble.output_head()
    owned = getattr(ensemble, "members", None)
    if isinstance(owned, nn.ModuleList) and all(hasattr(m, "output_head") for m in owned):
        heads = [m.output_head() for m in owned]  # dual encoders
        return torch.stack([w for w, _ in heads]), torch.stack([b for _, b in heads])
    try:
        if hasattr(ensemble, "feature_tap"):  # a fused Hydra model
            tap = ensemble.feature_tap()
            if tap is None:
                return None
            layers, config = tap.layers, ensemble.config
        elif isinstance(getattr(ensemble, "members", None), nn.ModuleList):  # one model per member
            layers = [logits_layers(member)[0] for member in ensemble.members]
            config = ensemble.members[0].config
        else:  # one model for every member
            layers, config = logits_layers(ensemble.model, members), ensemble.model.config
    except (FeatureError, TypeError):
        return None
    return member_heads(layers, members, int(config.num_labels))


@torch.no_grad()
def member_heads(
    layers: Sequence[nn.Module], num_members: int, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each member's output layer as ``(W (M, C, D), b (M, C))`` in float64: member m's logits are
    ``W[m] @ feature_m + b[m]`` (ViM reads them)."""
    weights, biases = [], []
    for m in range(num_members):
        layer = layers[m] if len(layers) == num_members else layers[0]
        w, b = _member_affine(layer, m, num_members, classes)
        weights.append(w.double())
        biases.append(torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double())
    return torch.stack(weights).cpu(), torch.stack(biases).cpu()


def _member_affine(layer: nn.Module, m: int, members: int, classes: int):
    if isinstance(layer, GroupedLinear):
        return layer.weight[m], None if layer.bias is None else layer.bias[m]
    if isinstance(layer, BatchEnsembleLinear):
        linear = layer.member_linear(m)
        return linear.weight, linear.bias
    if isinstance(layer, PackedLinear):
        if layer.groups == 1:
            return layer.weight[0], None if layer.bias is None else layer.bias[0]
        return layer.weight[m], None if layer.bias is None else layer.bias[m]
    weight, bias = layer.weight, layer.bias
    if weight.shape[0] == members * classes and members > 1:  # MIMO: member m's block of outputs
        rows = slice(m * classes, (m + 1) * classes)
        return weight[rows], None if bias is None else bias[rows]
    return weight, bias
