"""What a feature-space OOD score adds to the fused model's latency.

The fused Hydra model on the real MiniLM-L6 (M members keeping ``--keep`` of 12 heads per layer,
random inputs of ``--tokens`` tokens), timed interleaved in ``--rounds`` rounds of ``--repeats``
runs: the forward pass without recording features (``record_features = False``), and the forward
pass that records them followed by each feature score (float64, from statistics fit on random
training features of the same width). Target: every feature score adds at most 5% at batch 64.

    python benchmarks/feature_score_cost.py [--batches 8,64] [--rounds 3] [--repeats 7] [--precision auto]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import hydra_ensembles as he
from hydra_ensembles.cost import interleaved_latency
from hydra_ensembles.models import load_classifier, offline_by_default
from hydra_ensembles.ood import FeatureStatistics, feature_scores
from hydra_ensembles.ood.features import ensemble_heads
from hydra_ensembles.precision import PRECISIONS, in_precision, resolve_precision
from hydra_ensembles.runtime import describe_machine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--keep", type=int, default=8, help="heads kept per layer (of 12)")
    parser.add_argument("--train", type=int, default=1000, help="training features the statistics hold")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    offline_by_default()

    compute = resolve_precision(args.precision)
    base = in_precision(load_classifier(num_labels=4).eval(), compute)
    config = base.config
    flat = torch.zeros(config.num_hidden_layers, config.num_attention_heads)
    heads = he.sample_members(
        flat, args.members, heads_per_layer=args.keep, pool_size=config.num_attention_heads
    )
    hydra = he.fuse(base, heads).eval()
    plain = he.fuse(base, heads).eval()
    plain.record_features = False
    generator = torch.Generator().manual_seed(0)
    width = config.hidden_size
    train = torch.randn(args.members, args.train, width, generator=generator)
    labels = torch.arange(args.train) % config.num_labels
    stats = FeatureStatistics.fit(train, labels, config.num_labels, ensemble_heads(hydra))
    print(f"machine: {describe_machine()}\nprecision: {compute}")
    print(
        f"MiniLM-L6, M={args.members}, {args.keep}/{config.num_attention_heads} heads per layer, "
        f"{args.tokens} tokens; statistics of {args.train} training features; "
        f"{args.rounds} rounds x {args.repeats} runs"
    )
    results: dict = {"machine": describe_machine(), "precision": str(compute), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        ids = torch.randint(1000, config.vocab_size, (batch, args.tokens), generator=generator)
        x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def scored(score: str, x=x):
            with compute.autocast("cpu"):
                out = hydra(**x)
            return stats.member_scores(score, out.member_features, out.member_logits.float())

        def forward(x=x):
            with compute.autocast("cpu"):
                return plain(**x)

        runs = {
            "Hydra, no features": forward,
            **{f"Hydra + {s}": (lambda s=s: scored(s)) for s in feature_scores()},
        }
        rounds = []
        with torch.inference_mode():
            for _ in range(args.rounds):
                times = interleaved_latency(runs, repeats=args.repeats)
                rounds.append({name: statistics.median(t) for name, t in times.items()})
        ratios = {name: statistics.median(r[name] / r["Hydra, no features"] for r in rounds) for name in runs}
        median_ms = {name: 1e3 * statistics.median(r[name] for r in rounds) for name in runs}
        results["batches"][batch] = {"median_ms": median_ms, "ratio_to_forward": ratios}
        print(f"\nbatch {batch}:")
        for name in runs:
            met = "" if name == "Hydra, no features" else (" met" if ratios[name] <= 1.05 else " MISSED")
            share = f"x{ratios[name]:.3f} (median of per-round ratios)"
            print(f"  {name:22s} {median_ms[name]:9.1f} ms  {share}{met}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
