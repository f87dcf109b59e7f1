"""Choose LoRA-Ensemble's learning-rate multiple on the ID *validation* split (never on test or
OOD data): LoRA fine-tunes of the demo's starting model with several multiples of the recipe's
learning rate, each scored by validation NLL and accuracy.

Text: adapters on the pretrained MiniLM-L6; image: on the trained Single ViT, taken from the
demo's cache (run ``hydra-ens demo --task image`` first, or it is trained here).

    python benchmarks/lora_lr.py --task image --scales 1 3 10
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from hydra_ensembles.models import offline_by_default
from hydra_ensembles.runtime import ensure_cpu_allocator_tuned
from hydra_experiments import demo_starting_point, train_lora, validation_scores


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=["text", "image"], default="image")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 3.0, 10.0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    offline_by_default()
    ensure_cpu_allocator_tuned()
    config, bench, base = demo_starting_point(args.task)
    for scale in args.scales:
        recipe = replace(config.recipe, lora_lr_scale=scale)
        t = time.perf_counter()
        metrics = validation_scores(train_lora(bench, recipe, base, args.seed, config.lora_rank), bench)
        print(
            f"{args.task}: LoRA lr = {scale:g} x {config.recipe.lr:g}: val NLL {metrics['nll']:.4f}, "
            f"val acc {100 * metrics['acc']:.2f} ({time.perf_counter() - t:.0f} s)"
        )


if __name__ == "__main__":
    main()
