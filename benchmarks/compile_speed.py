"""Does torch.compile speed up the fused model, or change its cost relative to a deep ensemble?

MiniLM-L6 fused from 3 members x 8/12 random heads, ``--batch`` x 128 tokens, in ``--precision``
(default auto: bf16 only where this machine computes it natively and faster, else fp32).
Eager and compiled models are timed interleaved in one group; prints compile time, medians,
ratios and the largest logit difference. With ``--ensemble`` the Single model and the Deep
Ensemble (3 copies run one after another) are timed too, eager and compiled, so the Hydra /
Deep Ensemble ratio can be compared with and without compilation.

    python benchmarks/compile_speed.py [--precision auto] [--batch 64] [--repeats 5] [--ensemble]
                                       [--freezing]

``--freezing`` turns on inductor's freezing (weights treated as constants: prepacked for oneDNN,
linear + activation fused), an inference-only setting.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import hydra_ensembles as he
from hydra_ensembles.cost import interleaved_latency, median
from hydra_ensembles.models import load_classifier
from hydra_ensembles.precision import PRECISIONS, resolve_precision
from hydra_ensembles.runtime import describe_machine, ensure_cpu_allocator_tuned


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ensemble", action="store_true", help="also time Single and Deep Ensemble")
    parser.add_argument("--freezing", action="store_true", help="inductor freezing (inference only)")
    args = parser.parse_args()
    if args.freezing:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    ensure_cpu_allocator_tuned()
    compute = resolve_precision(args.precision)
    model = load_classifier(num_labels=4).eval().to(compute.dtype)
    hydra = he.fuse(model, he.sample_members(torch.zeros(6, 12), 3, heads_per_layer=8, pool_size=12)).eval()
    ids = torch.randint(1000, 30000, (args.batch, 128), generator=torch.Generator().manual_seed(0))
    raw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    stacked = hydra.stack_inputs(raw, args.batch)
    ensemble = [model] + [copy.deepcopy(model) for _ in range(2)]
    with torch.inference_mode():
        start = time.perf_counter()
        compiled = torch.compile(hydra.model, dynamic=False)
        compiled(**stacked)
        compiled_ensemble = []
        if args.ensemble:
            compiled_ensemble = [torch.compile(m, dynamic=False) for m in ensemble]
            for m in compiled_ensemble:
                m(**raw)
        compile_s = time.perf_counter() - start
        runs = {"Hydra eager": lambda: hydra.model(**stacked), "Hydra compiled": lambda: compiled(**stacked)}
        if args.ensemble:
            runs |= {
                "Single eager": lambda: model(**raw),
                "Single compiled": lambda: compiled_ensemble[0](**raw),
                "Deep Ensemble eager": lambda: [m(**raw) for m in ensemble],
                "Deep Ensemble compiled": lambda: [m(**raw) for m in compiled_ensemble],
            }
        times = {name: median(values) for name, values in interleaved_latency(runs, args.repeats).items()}
        diff = (hydra.model(**stacked).logits.float() - compiled(**stacked).logits.float()).abs().max().item()
    print(
        f"machine: {describe_machine()}; {compute}, batch {args.batch} x 128 tokens, M=3, 8/12 heads, "
        f"freezing {'on' if args.freezing else 'off'}"
    )
    print(f"compile + first calls {compile_s:.1f} s; max |Hydra logit diff| compiled vs eager {diff:.1e}")
    for name, seconds in times.items():
        print(f"  {name:24s} {seconds * 1e3:8.1f} ms")
    print(f"Hydra compiled / eager: {times['Hydra compiled'] / times['Hydra eager']:.3f}")
    if args.ensemble:
        for mode in ("eager", "compiled"):
            ratio = times[f"Hydra {mode}"] / times[f"Deep Ensemble {mode}"]
            print(f"Hydra / Deep Ensemble, both {mode}: {ratio:.3f}")


if __name__ == "__main__":
    main()
