"""What scoring costs for the unstructured baselines, on the demo's model and calibration data.

On the demo's fine-tuned Single model (text: MiniLM-L6; image: DINOv2-S at 56 px, from the
demo's cache or trained here) and the demo's calibration batches (its first 64 training items),
timed interleaved in ``--repeats`` rounds, medians in seconds and as multiples of one gradient
(forward + backward of the same weights):

- ``gradient``: the mean loss's gradient with respect to the attention and MLP weights
  (`analysis.gradient`: math attention, as OBA's second-order pass);
- ``oba``: OBA's scores (`baselines.unstructured.oba_scores`: gradient and one exact
  Hessian-vector product, by double backward);
- ``oba forward-over-reverse``: the same Hessian-vector product by forward-mode differentiation
  of the gradient (``torch.func.jvp`` over ``torch.func.grad``), the alternative to double
  backward; its largest difference from double backward is printed beside it;
- ``wanda``: Wanda's input norms (one forward pass);
- ``taylor``: Taylor head scores (`scoring.taylor_scores`, one backward of W_Q, W_K, W_V).

Then what each method removes, before any fine-tuning, at the demo's budget (as many weights as
its Taylor single pruned model removes parameters) and at ``--sparsities``: the mean
cross-entropy on the calibration batches (with OBA's Taylor estimate of the change) and on the ID
validation split, for OBA, Wanda and plain global magnitude pruning.

    python benchmarks/unstructured_scoring.py [--task text|image] [--repeats 5] [--sparsities 0.3,0.5]

Scoring runs in float32 whatever the precision ``auto`` picks (OBA always does).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel

import hydra_ensembles as he
from hydra_ensembles.analysis import gradient
from hydra_ensembles.baselines.unstructured import (
    input_norms,
    matched_sparsity,
    oba_masks,
    prunable_linears,
    taylor_loss_change,
    taylor_terms,
    wanda_masks,
)
from hydra_ensembles.batching import model_inputs
from hydra_ensembles.cost import interleaved_latency
from hydra_ensembles.models import offline_by_default
from hydra_ensembles.runtime import describe_machine, ensure_cpu_allocator_tuned
from hydra_ensembles.scoring import taylor_scores
from hydra_experiments import demo_starting_point


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


def loss_and_accuracy(model, batches) -> tuple[float, float]:
    """Mean cross-entropy and accuracy over every example of ``batches``."""
    total, right, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(**model_inputs(batch)).logits.float()
            total += F.cross_entropy(logits, batch["labels"], reduction="sum").item()
            right += int((logits.argmax(-1) == batch["labels"]).sum())
            count += len(batch["labels"])
    return total / count, right / count


def removal_report(config, bench, base, calib, sparsities: list[float]) -> None:
    """Losses right after pruning at the demo's budget and at ``sparsities``, per method
    (weights zeroed in place, restored after each)."""
    kept = {layer: list(range(config.heads_per_layer)) for layer in range(base.config.num_hidden_layers)}
    calib_loss, _ = loss_and_accuracy(base, calib)
    val_loss, val_acc = loss_and_accuracy(base, bench.val)
    print(f"before pruning: calibration loss {calib_loss:.4f}; ID val loss {val_loss:.4f}, acc {val_acc:.4f}")
    for sparsity in [matched_sparsity(base, he.prune(base, he.HeadSet(kept))), *sparsities]:
        print(f"{sparsity:.1%} of the attention and MLP weights pruned, no fine-tuning:")
        _removals(bench, base, calib, sparsity, calib_loss)


def _removals(bench, base, calib, sparsity: float, calib_loss: float) -> None:
    linears = prunable_linears(base)
    magnitude = torch.cat([m.weight.detach().abs().flatten() for m in linears.values()])
    threshold = magnitude.kthvalue(round(sparsity * magnitude.numel())).values
    masks = {
        "oba": oba_masks(base, calib, sparsity),
        "wanda": wanda_masks(base, calib, sparsity),
        "magnitude": {p: (m.weight.detach().abs() > threshold).float() for p, m in linears.items()},
    }
    for name, mask in masks.items():
        originals = {p: m.weight.detach().clone() for p, m in linears.items()}
        predicted = taylor_loss_change(base, calib, mask)
        with torch.no_grad():
            for p, m in linears.items():
                m.weight.mul_(mask[p])
        loss, _ = loss_and_accuracy(base, calib)
        v_loss, v_acc = loss_and_accuracy(base, bench.val)
        with torch.no_grad():
            for p, m in linears.items():
                m.weight.copy_(originals[p])
        print(
            f"{name:>10}: calibration loss change {loss - calib_loss:+.4f} (Taylor estimate "
            f"{predicted:+.4f}); ID val loss {v_loss:.4f}, acc {v_acc:.4f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=["text", "image"], default="text")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sparsities", default="0.3,0.5", help="shares pruned beside the demo's budget (comma-separated)"
    )
    args = parser.parse_args()
    offline_by_default()
    ensure_cpu_allocator_tuned()
    config, bench, base = demo_starting_point(args.task)
    base = base.float().eval()
    calib = bench.train[: max(1, 64 // config.recipe.batch_size)]
    direction = {p: -m.weight.detach() for p, m in prunable_linears(base).items()}
    weights = [m.weight for m in prunable_linears(base).values()]
    _, double_backward = taylor_terms(base, calib, direction)
    forward_mode = forward_over_reverse(base, calib, direction)
    gap = max((forward_mode[p].double() - h).abs().max().item() for p, h in double_backward.items())
    scale = max(h.abs().max().item() for h in double_backward.values())
    runs = {  # interleaved_latency times in inference mode: the gradient needs autograd back
        "gradient": lambda: differentiable(gradient)(base, calib, weights),
        "oba": lambda: taylor_terms(base, calib, direction),
        "oba forward-over-reverse": lambda: differentiable(forward_over_reverse)(base, calib, direction),
        "wanda": lambda: input_norms(base, calib),
        "taylor": lambda: differentiable(taylor_scores)(base, calib, False, "fp32"),
    }
    times = {k: statistics.median(v) for k, v in interleaved_latency(runs, args.repeats, warmup=1).items()}
    items = sum(len(b["labels"]) for b in calib)
    print(describe_machine())
    count = sum(w.numel() for w in weights)
    print(f"{config.model}: {count:,} attention and MLP weights; {items} calibration items")
    for name, seconds in times.items():
        print(f"{name:>26}: {seconds:7.3f} s  ({seconds / times['gradient']:.2f}x the gradient)")
    print(f"forward-over-reverse vs double backward: max |difference| {gap:.2e} (largest |H d| {scale:.2e})")
    removal_report(config, bench, base, calib, [float(x) for x in args.sparsities.split(",") if x])


if __name__ == "__main__":
    main()
