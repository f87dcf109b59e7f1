"""Fused Hydra vs the deep ensemble, from the plain Python API, in the precision ``auto`` picks.

What a user gets with ``he.fuse(...)`` then ``model(**inputs)`` and no setting of their own, on
the real MiniLM-L6 (M members keeping ``--keep`` of 12 heads per layer, random inputs of
``--tokens`` tokens): median latency of Single, the Deep Ensemble (M plain models one after
another), the pruned members one after another and the fused model, timed interleaved
(A B C D A B C D ...) in ``--rounds`` separate rounds of ``--repeats`` runs each. Two rows
attribute the result: the fused model without row chunking, and the deep ensemble run in the
same cache-sized chunks (what chunking alone would give a plain model).

Target: Hydra / Deep Ensemble latency <= multiply-add ratio + 0.05 at every batch size.

    python benchmarks/fused_latency.py [--batches 8,64] [--rounds 3] [--repeats 7] [--precision auto]

``HYDRA_CPU_BF16=native|emulated`` forces what ``auto`` believes about the CPU (to run the other
kind's path; its timings then are not that kind's).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from functools import partial

import torch

import hydra_ensembles as he
from hydra_ensembles.cost import interleaved_latency, multiply_adds
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.precision import PRECISIONS, in_precision, resolve_precision
from hydra_ensembles.runtime import describe_machine, inference_chunk_rows


def run_all(models: list, inputs: dict) -> list:
    return [m(**inputs) for m in models]


def run_chunked(models: list, inputs: dict, per: int) -> list:
    """Each model over the batch in chunks of ``per`` inputs (what HydraModel does inside)."""
    batch = inputs["input_ids"].shape[0]
    return [m(**{k: v[i : i + per] for k, v in inputs.items()}) for m in models for i in range(0, batch, per)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    offline_by_default()

    compute = resolve_precision(args.precision)
    base = in_precision(load_classifier(num_labels=4).eval(), compute)
    config = base.config
    flat = torch.zeros(
        config.num_hidden_layers, config.num_attention_heads
    )  # all heads equally likely: random members
    heads = he.sample_members(
        flat, args.members, heads_per_layer=args.keep, pool_size=config.num_attention_heads
    )
    ensemble = [base] + [copy.deepcopy(base) for _ in heads[1:]]
    members = [he.prune(base, hs).eval() for hs in heads]
    hydra = he.fuse(base, heads).eval()
    unchunked = he.fuse(base, heads).eval()
    unchunked.chunk_rows = None
    rows = inference_chunk_rows(config.intermediate_size, compute.dtype.itemsize, torch.device("cpu"))
    print(f"machine: {describe_machine()}")
    print(f"precision: {compute}")
    print(
        f"MiniLM-L6, M={args.members}, {args.keep}/{config.num_attention_heads} heads per layer, "
        f"{args.tokens} tokens; Hydra chunks inference into {rows} token rows; "
        f"{args.rounds} rounds x {args.repeats} interleaved runs"
    )
    generator = torch.Generator().manual_seed(0)
    results: dict = {"machine": describe_machine(), "precision": str(compute), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(1000, config.vocab_size, (batch, args.tokens), generator=generator)
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.inference_mode():  # chunking applies to inference only
            per = hydra.inputs_per_chunk(x, batch)
        runs = {
            "Single": partial(base, **x),
            "Deep Ensemble": partial(run_all, ensemble, x),
            "Members one by one": partial(run_all, members, x),
            "Hydra (fused)": partial(hydra, **x),
            "Hydra, no row chunks": partial(unchunked, **x),
            "Deep Ensemble, row chunks": partial(run_chunked, ensemble, x, max(1, per * args.members)),
        }
        with torch.inference_mode():
            macs = {name: multiply_adds(run) for name, run in runs.items()}
            diff = max(
                (hydra(**x).member_logits[i].float() - m(**x).logits.float()).abs().max().item()
                for i, m in enumerate(members)
            )
        rounds = []
        for _ in range(args.rounds):
            times = interleaved_latency(runs, repeats=args.repeats)
            rounds.append({name: statistics.median(t) for name, t in times.items()})
        median_ms = {name: 1e3 * statistics.median(r[name] for r in rounds) for name in runs}
        ratios = [r["Hydra (fused)"] / r["Deep Ensemble"] for r in rounds]
        mac_ratio = macs["Hydra (fused)"] / macs["Deep Ensemble"]
        ratio = statistics.median(ratios)
        met = ratio <= mac_ratio + 0.05
        results["batches"][batch] = {
            "median_ms": median_ms,
            "gmacs": {k: v / 1e9 for k, v in macs.items()},
            "hydra_vs_deep_ensemble_per_round": ratios,
            "hydra_vs_deep_ensemble": ratio,
            "mac_ratio": mac_ratio,
            "target_met": met,
            "max_abs_diff_fused_vs_members": diff,
        }
        print(f"\nbatch {batch} ({per} inputs per Hydra chunk):")
        for name in runs:
            share = median_ms[name] / median_ms["Deep Ensemble"]
            print(
                f"  {name:28s} {median_ms[name]:9.1f} ms  x{share:.3f} of Deep Ensemble  "
                f"{macs[name] / 1e9:6.2f} GMAC"
            )
        print(
            f"  Hydra / Deep Ensemble per round: {', '.join(f'{r:.3f}' for r in ratios)}; median {ratio:.3f} "
            f"vs multiply-add ratio {mac_ratio:.3f} + 0.05 -> {'met' if met else 'MISSED'}; "
            f"max |fused - members| {diff:.1e}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
