"""Circuit extraction over both towers of the zero-shot demo's dual encoder: reuse across towers
(the library's fast path) vs reuse within a tower only (what it did before), side by side.

A removal in one tower leaves the other tower's candidates unchanged down to their tower's output,
so the library scores them without running them (`scoring.circuit.candidates.SuffixCache`). The
comparison path is the same code with that switched off (every removal invalidates every
candidate above its layer). Model and data are the zero-shot demo's (all-MiniLM-L6-v2 as a dual
encoder on BBC News topics, its circuit texts and budget). Prints the machine, the precision,
each run's wall time (interleaved, ``--repeats`` each), the median ratio and whether the orders
are identical.

    python benchmarks/zero_shot_circuit_speed.py [--repeats 2] [--budget 24]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from tempfile import TemporaryDirectory

import hydra_ensembles.scoring.circuit as circuit
from hydra_ensembles.runtime import describe_machine
from hydra_ensembles.scoring.circuit import candidates, extract
from hydra_ensembles.surgery import original_heads_per_layer
from hydra_experiments import DemoConfig, start_run
from hydra_experiments.zero_shot import zero_shot_classifier


class WithinTowerOnly(candidates.SuffixCache):
    """The suffix cache without cross-tower reuse: a removal makes every candidate stale above
    its layer, whatever its tower."""

    def removed(self, head):
        for store in (self.states, self.valid, self.outputs):
            store.pop(head, None)
        self.complete = set()
        self.valid = {c: min(v, head[0]) for c, v in self.valid.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=int, default=None, help="heads to remove (default: the demo's)")
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        config = replace(
            DemoConfig.preset("zero-shot"), out_dir=Path(tmp) / "out", cache_dir=Path(tmp) / "cache"
        )
        run = start_run(config)
        model = zero_shot_classifier(config, run.task.classes, heads="both")
        budget = args.budget or config.circuit_budget
        library = extract.SuffixCache
        paths = {"across towers": library, "within a tower": WithinTowerOnly}
        times: dict[str, list[float]] = {name: [] for name in paths}
        orders = {}
        for _ in range(args.repeats):
            for name, cache in paths.items():
                extract.SuffixCache = cache
                try:
                    start = time.perf_counter()
                    order = circuit.extract_circuit(
                        model,
                        run.bench.circuit_id,
                        run.bench.circuit_ood,
                        objective="avg",
                        budget=budget,
                        precision=run.compute.name,
                        progress=False,
                    )
                    times[name].append(time.perf_counter() - start)
                finally:
                    extract.SuffixCache = library
                orders[name] = order.removed
                print(f"{name}: {times[name][-1]:.1f} s", flush=True)
    print(f"\nmachine: {describe_machine()}; precision: {run.compute}")
    print(
        f"pool: {sum(original_heads_per_layer(model))} heads of both towers, "
        f"budget {budget}, {config.circuit_id_items} + {config.circuit_ood_items} texts of "
        f"{config.circuit_length} tokens"
    )
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        print(f"{name}: median {median:.1f} s over {args.repeats} runs")
    print(f"speed-up: {medians['within a tower'] / medians['across towers']:.2f}x")
    print(f"identical orders: {orders['across towers'] == orders['within a tower']}")


if __name__ == "__main__":
    main()
