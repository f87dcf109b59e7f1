"""Fast vs reference circuit extraction on the real MiniLM-L6: same order, and the speed-up.

ID validation: BBC News articles (4 topics, the demo's split); OOD validation: BBC "tech"
articles. Both truncated to ``--tokens`` tokens. Prints wall time of each method, the speed-up,
and whether the two removal orders are identical.

    python benchmarks/circuit_speed.py [--budget 24] [--docs 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from hydra_ensembles.data import batches, load_bbc_news, split_indices, stable_sample
from hydra_ensembles.models import load_classifier, load_tokenizer, offline_by_default
from hydra_ensembles.runtime import tune_cpu_allocator
from hydra_ensembles.scoring import extract_circuit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--docs", type=int, default=16, help="ID and OOD validation documents each")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--objective", default="avg")
    args = parser.parse_args()
    offline_by_default()
    tune_cpu_allocator()
    torch.manual_seed(0)

    data = load_bbc_news(("business", "entertainment", "politics", "sports", "tech"))
    val = split_indices(data.ids, {"train": 0.6, "val": 0.2, "test": 0.2}, salt="bbc-news")["val"]
    id_idx = [i for i in val if data.classes[data.labels[i]] != "tech"]
    ood_idx = [i for i in val if data.classes[data.labels[i]] == "tech"]
    id_set = data.subset(stable_sample(id_idx, data.ids, args.docs))
    ood_set = data.subset(stable_sample(ood_idx, data.ids, args.docs))
    tokenizer = load_tokenizer()
    id_val = list(batches(id_set, tokenizer, batch_size=args.docs, max_length=args.tokens))
    ood_val = [
        {k: v for k, v in b.items() if k != "labels"}
        for b in batches(ood_set, tokenizer, args.docs, args.tokens)
    ]
    model = load_classifier(num_labels=5).eval()  # untrained head: a timing run, not a quality run

    times, orders = {}, {}
    for method in ("fast", "reference"):
        start = time.perf_counter()
        orders[method] = extract_circuit(
            model, id_val, ood_val, objective=args.objective, budget=args.budget, method=method
        )
        times[method] = time.perf_counter() - start
        print(f"{method:9s} {times[method]:8.1f} s")
    same = orders["fast"].removed == orders["reference"].removed
    print(
        f"MiniLM-L6, budget {args.budget}, {args.docs} ID + {args.docs} OOD docs x {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads: speed-up {times['reference'] / times['fast']:.2f}x; "
        f"identical order: {same}"
    )


if __name__ == "__main__":
    main()
