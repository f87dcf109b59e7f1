"""What scoring costs for the unstructured baselines, on the demo's model and calibration data.

On the demo's fine-tuned Single model (text: MiniLM-L6; image: DINOv2-S at 56 px, from the
demo's cache or trained here) and the demo's calibration batches (its first 64 training items),
timed interleaved in ``--repeats`` rounds, medians in seconds and as multiples of one gradient
(forward + backward of the same weights):

- ``gradient``: the mean loss's gradient with respect to the attention and MLP weights;
- ``oba``: OBA's scores (`members.unstructured.oba_scores`: gradient and one exact
  Hessian-vector product, by double backward);
- ``oba forward-over-reverse``: the same Hessian-vector product by forward-mode differentiation
  of the gradient (``torch.func.jvp`` over ``torch.func.grad``), the alternative to double
  backward; its largest difference from double backward is printed beside it;
- ``wanda``: Wanda's input norms (one forward pass);
- ``taylor``: Taylor head scores (`scoring.taylor_scores`, one backward of W_Q, W_K, W_V).

    python benchmarks/unstructured_scoring.py [--task text|image] [--repeats 5]

Scoring runs in float32 whatever the precision ``auto`` picks (OBA always does).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

from hydra_ensembles.batching import model_inputs
from hydra_ensembles.cost import interleaved_latency
from hydra_ensembles.experiment import demo_starting_point
from hydra_ensembles.members.unstructured import input_norms, prunable_linears, taylor_terms
from hydra_ensembles.models import offline_by_default
from hydra_ensembles.runtime import describe_machine, ensure_cpu_allocator_tuned
from hydra_ensembles.scoring import taylor_scores


def differentiable(fn):
    """``fn`` with autograd on, whatever the caller's mode."""

    def run(*args):
        with torch.inference_mode(False), torch.enable_grad():
            return fn(*args)

    return run


def forward_over_reverse(model, batches, direction) -> dict[str, torch.Tensor]:
    """H d by ``jvp`` of ``grad`` (forward over reverse), for comparison with double backward."""
    names = {f"{path}.weight": path for path in direction}
    params = {n: model.get_parameter(n).detach() for n in names}
    tangents = {n: direction[p] for n, p in names.items()}
    examples = sum(len(b["labels"]) for b in batches)

    def loss(weights):
        total = 0.0
        for batch in batches:
            logits = functional_call(model, weights, args=(), kwargs=model_inputs(batch)).logits
            total = total + F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        return total / examples

    with sdpa_kernel(SDPBackend.MATH):
        _, hvp = jvp(grad(loss), (params,), (tangents,))
    return {names[n]: h for n, h in hvp.items()}


def gradient(model, batches) -> None:
    """The gradient of the mean loss with respect to the attention and MLP weights."""
    weights = [m.weight for m in prunable_linears(model).values()]
    for batch in batches:
        loss = F.cross_entropy(model(**model_inputs(batch)).logits.float(), batch["labels"])
        torch.autograd.grad(loss, weights)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=["text", "image"], default="text")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    offline_by_default()
    ensure_cpu_allocator_tuned()
    config, bench, base = demo_starting_point(args.task)
    base = base.float().eval()
    for name, param in base.named_parameters():  # gradients of the attention and MLP weights only
        param.requires_grad_(any(name == f"{path}.weight" for path in prunable_linears(base)))
    calib = bench.train[: max(1, 64 // config.budget.batch_size)]
    direction = {p: -m.weight.detach() for p, m in prunable_linears(base).items()}
    _, double_backward = taylor_terms(base, calib, direction)
    forward_mode = forward_over_reverse(base, calib, direction)
    gap = max((forward_mode[p].double() - h).abs().max().item() for p, h in double_backward.items())
    scale = max(h.abs().max().item() for h in double_backward.values())
    runs = {  # interleaved_latency times in inference mode: the gradient needs autograd back
        "gradient": lambda: differentiable(gradient)(base, calib),
        "oba": lambda: taylor_terms(base, calib, direction),
        "oba forward-over-reverse": lambda: differentiable(forward_over_reverse)(base, calib, direction),
        "wanda": lambda: input_norms(base, calib),
        "taylor": lambda: differentiable(taylor_scores)(base, calib, False, "fp32"),
    }
    times = {k: statistics.median(v) for k, v in interleaved_latency(runs, args.repeats, warmup=1).items()}
    weights = sum(d.numel() for d in direction.values())
    items = sum(len(b["labels"]) for b in calib)
    print(describe_machine())
    print(f"{config.model}: {weights:,} attention and MLP weights; {items} calibration items")
    for name, seconds in times.items():
        print(f"{name:>26}: {seconds:7.3f} s  ({seconds / times['gradient']:.2f}x the gradient)")
    print(f"forward-over-reverse vs double backward: max |difference| {gap:.2e} (largest |H d| {scale:.2e})")


if __name__ == "__main__":
    main()
