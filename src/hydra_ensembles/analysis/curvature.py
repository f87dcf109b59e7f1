"""Proposition 1's conditions, measured (paper appendix A.2 and B.1).

Pruning heads moves the weights by ``delta`` (minus the removed heads' rows of W_Q, W_K, W_V
and their biases, and columns of W_O). To second order, the change in the gap between the loss
on noisy data (D^n) and on clean data (D^t) is

    dGap = grad L_n . delta - grad L_t . delta + 1/2 delta^T (H_n - H_t) delta,

and Proposition 1 says pruning widens the gap when grad L_n . delta >= 0 (alignment) and
H_n - H_t is positive definite. `proposition1` measures, for one head set:

* the alignment ``grad L_n . delta`` (the paper: 1.19 on CIFAR-100, 0.37 on ImageNet) and, for
  reference, ``grad L_t . delta`` (Assumption 1 takes it to be 0);
* the curvature gap along delta, ``1/2 delta^T (H_n - H_t) delta``, exactly (two Hessian-vector
  products);
* the paper's diagonal test: the mean over delta's support of diag(H_n) - diag(H_t), estimated
  with Hutchinson's estimator (Rademacher probes z: diag(H) = E[z * Hz]), the same probes for
  both datasets, with the standard error over probes (the paper: 0.45 and 0.17);
* the gap change the expansion predicts and the one measured by actually pruning.

Everything is computed in float32 with PyTorch's math attention (the fused CPU kernels have no
second derivative), dropout off; the model is left as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..adapters import get_adapter
from ..batching import model_inputs
from ..errors import InputError
from ..heads import HeadSet
from ..inputs import checked_batches
from ..progress import progress_bar
from ..surgery import ablate, kept_heads

Batches = Sequence[dict[str, Any]]


def attention_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """W_Q, W_K, W_V, W_O (weights and biases) of every layer: what head pruning changes."""
    adapter = get_adapter(model)
    params: dict[str, nn.Parameter] = {}
    for layer in range(adapter.num_layers(model)):
        block = adapter.attention_block(model, layer)
        if block.packed_qkv is not None:
            raise NotImplementedError(
                "the curvature analysis needs W_Q, W_K and W_V as separate weights; "
                f"{adapter.family} packs them"
            )
        for name, linear in zip("qkvo", (block.query, block.key, block.value, block.output), strict=True):
            params[f"{layer}.{name}.weight"] = linear.weight
            if linear.bias is not None and name != "o":  # W_O's bias stays when heads go
                params[f"{layer}.{name}.bias"] = linear.bias
    return params


def pruning_perturbation(model: nn.Module, heads: HeadSet) -> dict[str, torch.Tensor]:
    """``delta`` with ``model + delta`` = ``model`` keeping only ``heads`` (minus the removed
    heads' Q/K/V rows and biases and W_O columns; zero elsewhere), keyed like
    `attention_parameters`."""
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    current = kept_heads(model).resolve(original)
    target = heads.resolve(original)
    delta = {}
    for name, param in attention_parameters(model).items():
        layer, proj, _ = name.split(".")
        block = adapter.attention_block(model, int(layer))
        dh = block.head_dim
        removed = [i for i, h in enumerate(current[int(layer)]) if h not in target[int(layer)]]
        if proj in "kv" and block.kv_index is not None:  # a key/value head goes with its whole group
            read = {block.kv_index[i] for i in range(block.num_heads) if i not in removed}
            removed = sorted(set(block.kv_index) - read)
        change = torch.zeros_like(param, dtype=torch.float32)
        for position in removed:
            span = slice(position * dh, (position + 1) * dh)
            if proj == "o":
                change[:, span] = -param.detach()[:, span].float()
            else:
                change[span] = -param.detach()[span].float()
        delta[name] = change
    return delta


def _mean_loss(model: nn.Module, batches: Batches) -> torch.Tensor:
    """Mean cross-entropy over the batches (each batch's mean, averaged), in float32."""
    total = 0.0
    for batch in batches:
        logits = model(**model_inputs(batch)).logits.float()
        total = total + F.cross_entropy(logits, batch["labels"].to(logits.device)) / len(batches)
    return total


class Differentiable:
    """The model in eval mode, math attention (differentiable twice), gradients only for
    ``params``; its flags and mode are restored on exit. What every second-order computation
    (curvature here, OBA's scores) runs under."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.model, self.params = model, list(params)

    def __enter__(self) -> Differentiable:
        self._flags = {p: p.requires_grad for p in self.model.parameters()}
        self._training = self.model.training
        self._kernel = sdpa_kernel(SDPBackend.MATH)
        self._kernel.__enter__()
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in self.params:
            p.requires_grad_(True)
        self.model.eval()
        return self

    def __exit__(self, *exc) -> None:
        self._kernel.__exit__(*exc)
        for p, flag in self._flags.items():
            p.requires_grad_(flag)
        self.model.train(self._training)


def gradient(model: nn.Module, batches: Batches, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """The gradient of the mean loss over ``batches`` with respect to ``params``."""
    with Differentiable(model, params):
        return [g.detach() for g in torch.autograd.grad(_mean_loss(model, batches), params)]


def hessian_vector_products(
    model: nn.Module,
    batches: Batches,
    params: Sequence[nn.Parameter],
    vectors: Sequence[Sequence[torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """``H v`` for every ``v`` in ``vectors`` (H: the Hessian of the mean loss over ``batches``
    in ``params``), batch by batch (double backward; one graph per batch)."""
    results = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in vectors]
    with Differentiable(model, params):
        for batch in batches:
            loss = _mean_loss(model, [batch]) / len(batches)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for i, vector in enumerate(vectors):
                dot = sum((g * v.to(g.dtype)).sum() for g, v in zip(grads, vector, strict=True))
                hv = torch.autograd.grad(dot, params, retain_graph=i < len(vectors) - 1)
                for acc, h in zip(results[i], hv, strict=True):
                    acc += h.detach().float()
    return results


def rademacher(like: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """Independent +-1 entries shaped like ``like``."""
    return [
        torch.randint(0, 2, p.shape, generator=generator, dtype=torch.float32).mul_(2).sub_(1).to(p.device)
        for p in like
    ]


def hutchinson_diagonal(
    model: nn.Module,
    batches: Batches,
    params: Sequence[nn.Parameter],
    probes: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Hutchinson's estimate of the Hessian diagonal, ``mean_k z_k * (H z_k)`` over ``probes``
    Rademacher vectors, and each entry's standard error (std over probes / sqrt(probes))."""
    if probes < 2:
        raise InputError(f"probes must be at least 2 (the standard error needs two), got {probes}")
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in progress_bar(range(probes), desc="hutchinson", leave=False, enabled=progress):
        z = rademacher(params, generator)
        (hz,) = hessian_vector_products(model, batches, params, [z])
        samples.append([a * b for a, b in zip(z, hz, strict=True)])
    stacked = [torch.stack(s) for s in zip(*samples, strict=True)]
    return [s.mean(0) for s in stacked], [s.std(0) / math.sqrt(probes) for s in stacked]


@dataclass(frozen=True)
class Proposition1Result:
    """Proposition 1's quantities for one pruning perturbation (see the module docstring)."""

    heads_removed: int
    alignment_noisy: float
    """grad L_n . delta: Proposition 1 needs it >= 0."""
    alignment_clean: float
    """grad L_t . delta: Assumption 1 takes it to be 0."""
    curvature_gap: float
    """1/2 delta^T (H_n - H_t) delta, exact."""
    diagonal_gap: float
    """Mean over delta's support of diag(H_n) - diag(H_t) (Hutchinson)."""
    diagonal_gap_stderr: float
    """Its standard error over probes."""
    diagonal_gap_positive: float
    """Share of delta's support whose estimated diagonal gap is positive."""
    probes: int
    predicted_gap_change: float
    """(grad L_n - grad L_t) . delta + 1/2 delta^T (H_n - H_t) delta."""
    measured_gap_change: float
    """[L_n - L_t](pruned) - [L_n - L_t](unpruned), by masking the heads."""
    loss_clean: float
    loss_noisy: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _dot(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True)))


def proposition1(
    model: nn.Module,
    clean: Iterable[dict[str, Any]],
    noisy: Iterable[dict[str, Any]],
    heads: HeadSet | Mapping[str, HeadSet],
    probes: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> Proposition1Result | dict[str, Proposition1Result]:
    """Measure Proposition 1's conditions for pruning ``model`` to ``heads`` (labelled batches of
    clean data D^t and noisy data D^n; see the module docstring). Several head sets (a mapping
    name -> HeadSet) share the gradients and the Hutchinson probes: one result per name."""
    if isinstance(heads, HeadSet):
        return proposition1(model, clean, noisy, {"": heads}, probes, seed, progress)[""]
    if probes < 2:
        raise InputError(f"probes must be at least 2 (the standard error needs two), got {probes}")
    num_labels = int(model.config.num_labels)
    clean = checked_batches(clean, "clean", num_labels, model=model)
    noisy = checked_batches(noisy, "noisy", num_labels, model=model)
    params = list(attention_parameters(model).values())
    original = get_adapter(model).original_heads_per_layer(model)
    deltas, supports, counts = _perturbations(model, heads)
    bar = progress_bar(total=2 + 2 * len(heads) + probes + 1, desc="proposition 1", enabled=progress)

    def step(fn: Callable[[], Any]) -> Any:
        out = fn()
        bar.update()
        return out

    grad_n = step(lambda: gradient(model, noisy, params))
    grad_t = step(lambda: gradient(model, clean, params))
    curvature = _curvature_gaps(model, clean, noisy, params, deltas, step)

    per_probe, gap_sum = _diagonal_gaps(model, clean, noisy, params, supports, probes, seed, bar.update)
    losses = _losses(model, clean, noisy, heads)
    bar.update()
    bar.close()
    measured = _Measured(
        grad_n, grad_t, curvature, per_probe, gap_sum, losses, deltas, supports, counts, probes
    )
    kept = kept_heads(model).num_kept(original)
    return {name: measured.result(name, kept - hs.num_kept(original)) for name, hs in heads.items()}


@dataclass(frozen=True)
class _Measured:
    """What `proposition1` measured once for every head set, by head-set name where it depends
    on one."""

    grad_noisy: list[torch.Tensor]
    grad_clean: list[torch.Tensor]
    curvature: dict[str, float]
    per_probe: dict[str, list[float]]
    gap_sum: list[torch.Tensor]
    losses: dict[Any, tuple[float, float]]
    deltas: dict[str, list[torch.Tensor]]
    supports: dict[str, list[torch.Tensor]]
    counts: dict[str, int]
    probes: int

    def result(self, name: str, heads_removed: int) -> Proposition1Result:
        """The conditions for the head set ``name``, which removes ``heads_removed`` heads."""
        delta, support, count = self.deltas[name], self.supports[name], self.counts[name]
        values = torch.tensor(self.per_probe[name], dtype=torch.float64) / count
        alignment_n, alignment_t = _dot(self.grad_noisy, delta), _dot(self.grad_clean, delta)
        positive = sum(int(((g > 0) & s).sum()) for g, s in zip(self.gap_sum, support, strict=True))
        before, after = self.losses[None], self.losses[name]
        return Proposition1Result(
            heads_removed=heads_removed,
            alignment_noisy=alignment_n,
            alignment_clean=alignment_t,
            curvature_gap=self.curvature[name],
            diagonal_gap=float(values.mean()),
            diagonal_gap_stderr=float(values.std() / math.sqrt(self.probes)),
            diagonal_gap_positive=positive / count,
            probes=self.probes,
            predicted_gap_change=alignment_n - alignment_t + self.curvature[name],
            measured_gap_change=(after[0] - after[1]) - (before[0] - before[1]),
            loss_clean=before[1],
            loss_noisy=before[0],
        )


def _curvature_gaps(model, clean, noisy, params, deltas: dict, step: Callable) -> dict[str, float]:
    """Per head set, half the curvature gap along its perturbation ``delta``:
    ``(delta^T H_n delta - delta^T H_t delta) / 2``, by Hessian-vector products (each a ``step``)."""
    curvature = {}
    for name, delta in deltas.items():
        (h_n,) = step(lambda d=delta: hessian_vector_products(model, noisy, params, [d]))
        (h_t,) = step(lambda d=delta: hessian_vector_products(model, clean, params, [d]))
        curvature[name] = 0.5 * (_dot(delta, h_n) - _dot(delta, h_t))
    return curvature


def _perturbations(
    model: nn.Module, heads: Mapping[str, HeadSet]
) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]], dict[str, int]]:
    """Per head set: the pruning perturbation of each attention weight, where it is non-zero, and
    how many weights it moves (refused where that is none)."""
    deltas = {name: list(pruning_perturbation(model, hs).values()) for name, hs in heads.items()}
    supports = {name: [d != 0 for d in delta] for name, delta in deltas.items()}
    counts = {name: int(sum(int(s.sum()) for s in support)) for name, support in supports.items()}
    for name, count in counts.items():
        if count == 0:
            raise InputError(
                f"the head set {name!r} removes no head: there is no pruning perturbation to study"
            )
    return deltas, supports, counts


def _diagonal_gaps(
    model: nn.Module,
    clean: list[dict[str, Any]],
    noisy: list[dict[str, Any]],
    params: list[nn.Parameter],
    supports: Mapping[str, list[torch.Tensor]],
    probes: int,
    seed: int,
    done: Callable[[], Any],
) -> tuple[dict[str, list[float]], list[torch.Tensor]]:
    """Hutchinson's estimate of diag(H_n - H_t): per head set, each probe's sum over its support
    (divide by the support size for the mean), and the sum of the per-weight estimates over the
    probes. The same probe serves both datasets: their difference has less noise."""
    generator = torch.Generator().manual_seed(seed)
    per_probe: dict[str, list[float]] = {name: [] for name in supports}
    gap_sum = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for _ in range(probes):
        z = rademacher(params, generator)
        (hz_n,) = hessian_vector_products(model, noisy, params, [z])
        (hz_t,) = hessian_vector_products(model, clean, params, [z])
        gap = [zi * (a - b) for zi, a, b in zip(z, hz_n, hz_t, strict=True)]
        for acc, g in zip(gap_sum, gap, strict=True):
            acc += g
        for name, support in supports.items():
            per_probe[name].append(sum(float(g[s].sum()) for g, s in zip(gap, support, strict=True)))
        done()
    return per_probe, gap_sum


def _losses(
    model: nn.Module, clean: list[dict[str, Any]], noisy: list[dict[str, Any]], heads: Mapping[str, HeadSet]
) -> dict[str | None, tuple[float, float]]:
    """(noisy, clean) mean losses of the model (key ``None``) and with each head set's pruning."""
    losses: dict[str | None, tuple[float, float]] = {}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        was_training = model.training
        model.eval()
        losses[None] = float(_mean_loss(model, noisy)), float(_mean_loss(model, clean))
        for name, hs in heads.items():
            with ablate(model, hs):
                losses[name] = float(_mean_loss(model, noisy)), float(_mean_loss(model, clean))
        model.train(was_training)
    return losses
