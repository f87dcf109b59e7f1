"""Circuit extraction on the real MiniLM-L6: exact fast vs reference (same order, speed-up), and
the approximate lazy mode (speed-up and agreement with the exact order).

The model is MiniLM-L6 fine-tuned for one epoch on 320 BBC News training texts (4 topics; the
demo's split and recipe), so that the objective means something. ID validation: BBC News
validation articles; OOD validation: BBC "tech" articles. Both truncated to ``--tokens`` tokens.
Prints wall time per method (the median of ``--repeats`` interleaved runs for the exact
methods), speed-ups over the reference, whether the exact orders are
identical, and for each lazy setting: the share of steps removing the same head as the exact
order, the overlap (Jaccard) of the removed sets, and the objective S at the budget.

    python benchmarks/circuit_speed.py [--budget 24] [--docs 16] [--tokens 32] [--lazy 8 16] [--repeats 2]

With ``--precisions``: the fast method in fp32, in bf16 with fp32 re-scoring (bf16's default) and
in bf16 alone, interleaved, with their median times and whether each gives fp32's order.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hydra_ensembles.data import split_indices, stable_sample, to_batches
from hydra_ensembles.models import load_classifier, load_tokenizer, offline_by_default
from hydra_ensembles.runtime import describe_machine, ensure_cpu_allocator_tuned
from hydra_ensembles.scoring import extract_circuit
from hydra_ensembles.training import fine_tune
from hydra_experiments import TrainingRecipe
from hydra_experiments.datasets import load_bbc_news

TOPICS = ("business", "entertainment", "politics", "sports")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--docs", type=int, default=16, help="ID and OOD validation documents each")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--objective", default="avg")
    parser.add_argument("--lazy", type=int, nargs="*", default=[8, 16], help="shortlist sizes to try")
    parser.add_argument("--refresh-every", type=int, default=8)
    parser.add_argument("--skip-reference", action="store_true", help="time only fast and lazy")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of fast and reference, interleaved; medians reported"
    )
    parser.add_argument(
        "--precisions",
        action="store_true",
        help="instead: the fast method in fp32, in bf16 with fp32 re-scoring (the default in bf16) "
        "and in bf16 alone; times and whether each order is fp32's",
    )
    args = parser.parse_args()
    offline_by_default()
    ensure_cpu_allocator_tuned()
    torch.manual_seed(0)

    data = load_bbc_news((*TOPICS, "tech"))
    parts = split_indices(data.ids, {"train": 0.6, "val": 0.2, "test": 0.2}, salt="bbc-news")
    tech = data.classes.index("tech")

    def pick(split: str, ood: bool, limit: int):
        chosen = [i for i in parts[split] if (data.labels[i] == tech) == ood]
        return data.subset(stable_sample(chosen, data.ids, limit, salt=split))

    tokenizer = load_tokenizer()
    train = list(to_batches(pick("train", False, 320), tokenizer, 16, 32))
    id_val = list(to_batches(pick("val", False, args.docs), tokenizer, args.docs, args.tokens))
    ood_val = [
        {k: v for k, v in b.items() if k != "labels"}
        for b in to_batches(pick("val", True, args.docs), tokenizer, args.docs, args.tokens)
    ]
    model = load_classifier(num_labels=5)  # BBC's 5 topic labels; tech never appears in training
    start = time.perf_counter()
    fine_tune(model, train, None, TrainingRecipe(epochs=1).config(0), progress=False)
    print(f"fine-tuned MiniLM-L6 for 1 epoch on 320 texts in {time.perf_counter() - start:.0f} s")
    model.eval()

    if args.precisions:
        return compare_precisions(model, id_val, ood_val, args)
    exact_runs = [("fast", {}), *([] if args.skip_reference else [("reference", {})])]
    runs = exact_runs * args.repeats  # interleaved: fast, reference, fast, reference, ...
    runs += [
        (f"lazy-{k}", {"method": "lazy", "shortlist": k, "refresh_every": args.refresh_every})
        for k in args.lazy
    ]
    runs_of: dict[str, list[float]] = {}
    orders = {}
    for name, kwargs in runs:
        start = time.perf_counter()
        order = extract_circuit(
            model,
            id_val,
            ood_val,
            objective=args.objective,
            budget=args.budget,
            method=kwargs.get("method", name),
            progress=False,
            precision="fp32",  # the orders of the exact paths agree in fp32 (bf16 rounds near-ties)
            **{k: v for k, v in kwargs.items() if k != "method"},
        )
        runs_of.setdefault(name, []).append(time.perf_counter() - start)
        if name in orders and orders[name] != order:
            raise SystemExit(f"{name}: two runs gave different orders")
        orders[name] = order
        print(f"{name:10s} {runs_of[name][-1]:8.1f} s")
    times = {name: statistics.median(seconds) for name, seconds in runs_of.items()}

    setting = (
        f"MiniLM-L6 (fine-tuned), budget {args.budget}, objective {args.objective}, {args.docs} ID + "
        f"{args.docs} OOD docs x {args.tokens} tokens, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved run(s) for fast and reference"
    )
    print(setting)
    exact = orders["fast"].removed
    if "reference" in orders:
        same = orders["reference"].removed == exact
        print(
            f"fast vs reference: speed-up {times['reference'] / times['fast']:.2f}x; identical order: {same}"
        )
    for name in times:
        if not name.startswith("lazy"):
            continue
        removed = orders[name].removed
        steps = sum(a == b for a, b in zip(removed, exact, strict=True)) / len(exact)
        overlap = len(set(removed) & set(exact)) / len(set(removed) | set(exact))
        versus = {k: times[k] / times[name] for k in ("reference", "fast") if k in times}
        print(
            f"{name}: "
            + ", ".join(f"{v:.2f}x faster than {k}" for k, v in versus.items())
            + f"; same head at {100 * steps:.0f}% of steps; removed-set Jaccard {overlap:.2f}; "
            f"S at budget {orders[name].scores[-1]:.4f} (exact {orders['fast'].scores[-1]:.4f})"
        )


def compare_precisions(model, id_val, ood_val, args) -> None:
    """fp32, bf16 + fp32 re-scoring, bf16 alone: interleaved, medians, orders against fp32's."""
    settings = {
        "fp32": {"precision": "fp32"},
        "bf16 + fp32 re-scoring": {"precision": "bf16"},
        "bf16 alone": {"precision": "bf16", "rescore": False},
    }
    times: dict[str, list[float]] = {name: [] for name in settings}
    orders = {}
    for _ in range(args.repeats):
        for name, kwargs in settings.items():
            start = time.perf_counter()
            order = extract_circuit(
                model, id_val, ood_val, objective=args.objective, budget=args.budget, progress=False, **kwargs
            )
            times[name].append(time.perf_counter() - start)
            if orders.setdefault(name, order) != order:
                raise SystemExit(f"{name}: two runs gave different orders")
            print(f"{name:24s} {times[name][-1]:8.1f} s")
    print(
        f"MiniLM-L6 (fine-tuned), budget {args.budget}, objective {args.objective}, {args.docs} ID + "
        f"{args.docs} OOD docs x {args.tokens} tokens, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved run(s); {describe_machine()}"
    )
    fp32 = orders["fp32"].removed
    base = statistics.median(times["fp32"])
    for name, order in orders.items():
        median = statistics.median(times[name])
        same = sum(a == b for a, b in zip(order.removed, fp32, strict=True))
        print(
            f"{name:24s} median {median:7.1f} s ({base / median:.2f}x fp32's speed); "
            f"fp32's order: {order.removed == fp32} (same head at {same} of {len(fp32)} steps)"
        )


if __name__ == "__main__":
    main()
