"""Choose BatchEnsemble's factor spread (``init_std``) on the ID *validation* split (never on
test or OOD data): BatchEnsembles of the demo's starting model with several spreads, each
fine-tuned as in the demo and scored by the ensemble's validation NLL and accuracy.

Text: from the pretrained MiniLM-L6; image: from the trained Single ViT, taken from the demo's
cache (run ``hydra-ens demo --task image`` first, or it is trained here).

    python benchmarks/batch_ensemble_std.py --task text --stds 0.05 0.1 0.5
"""

from __future__ import annotations

import argparse
import time

from hydra_ensembles.models import offline_by_default
from hydra_ensembles.runtime import ensure_cpu_allocator_tuned
from hydra_experiments import demo_starting_point, train_batch_ensemble, validation_scores


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=["text", "image"], default="text")
    parser.add_argument("--stds", type=float, nargs="+", default=[0.05, 0.1, 0.5])
    args = parser.parse_args()
    offline_by_default()
    ensure_cpu_allocator_tuned()
    config, bench, base = demo_starting_point(args.task)  # only the spread differs between runs
    for std in args.stds:
        t = time.perf_counter()
        model = train_batch_ensemble(bench, config.recipe, base, config.members, std)
        metrics = validation_scores(model, bench)
        print(
            f"{args.task}: BatchEnsemble init_std {std:g}: val NLL {metrics['nll']:.4f}, "
            f"val acc {100 * metrics['acc']:.2f} ({time.perf_counter() - t:.0f} s)"
        )


if __name__ == "__main__":
    main()
