"""Rows per second of ``hydra-ens predict`` in one process against ``--engine ray`` (embedded
on this machine, 1 and 2 workers), side by side in one run, and Ray's fixed cost.

    python benchmarks/distributed_scoring.py [--rows 10000 100000] [--repeats 2]

The model: all-MiniLM-L6-v2 (from its PyPI wheel) with a seeded 4-class head, saved once; the
data: short synthetic texts (5-12 words), in 8 CSV files per size so that Ray reads them in
parallel; --max-length 32, --batch-size 64. Each setting runs ``--repeats`` times, the settings
interleaved, and the median is printed. Ray's fixed cost is measured alone: starting an embedded
instance and shutting it down. The per-row overhead is what a Ray job costs beyond that fixed
cost and one process's time for the same rows, divided by the rows. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

WORDS = tuple(
    [
        "market",
        "bank",
        "shares",
        "profit",
        "goal",
        "match",
        "team",
        "score",
        "film",
        "music",
        "band",
        "actor",
        "recipe",
        "flour",
        "oven",
        "election",
        "vote",
        "minister",
        "court",
        "storm",
        "rain",
        "river",
        "mountain",
        "phone",
        "chip",
        "software",
        "update",
    ]
)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 13)))) for _ in range(n)]


def _model(folder: Path) -> Path:
    from hydra_ensembles.models import load_classifier, load_tokenizer

    torch.manual_seed(0)
    load_classifier(num_labels=4).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


def _corpus(folder: Path, rows: int) -> Path:
    folder.mkdir()
    texts = _texts(rows)
    for part in range(8):
        (folder / f"part{part}.csv").write_text("text\n" + "\n".join(texts[part::8]) + "\n")
    return folder


def _timed(args: list[str]) -> float:
    from hydra_cli import main

    started = time.perf_counter()
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        code = main(args)
    if code != 0:
        raise SystemExit(f"hydra-ens {' '.join(args)} failed ({code}):\n{said.getvalue()[-3000:]}")
    return time.perf_counter() - started


def _ray_fixed_cost() -> float:
    import ray

    started = time.perf_counter()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ray.shutdown()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=2)
    opts = parser.parse_args()
    common = ["--batch-size", "64", "--max-length", "32", "--precision", "auto"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(_model(root / "model"))
        fixed = statistics.median(_ray_fixed_cost() for _ in range(opts.repeats))
        print(f"Ray's fixed cost (embedded start and shutdown): {fixed:.1f} s")
        header = ("rows", "engine", "seconds", "rows/s", "vs one process", "overhead/row")
        print("{:>8} {:<16} {:>8} {:>8} {:>15} {:>13}".format(*header))
        for rows in opts.rows:
            corpus = _corpus(root / f"corpus{rows}", rows)
            settings = {
                "one process": ["--out", str(root / "p.jsonl")],
                "ray, 1 worker": ["--engine", "ray", "--workers", "1", "--out", str(root / "r1")],
                "ray, 2 workers": ["--engine", "ray", "--workers", "2", "--out", str(root / "r2")],
            }
            times: dict[str, list[float]] = {name: [] for name in settings}
            for _ in range(opts.repeats):
                for name, extra in settings.items():
                    data = str(corpus / "*.csv") if "ray" in name else str(_one_file(corpus))
                    times[name].append(_timed(["predict", model, "--data", data, *extra, *common]))
            single = statistics.median(times["one process"])
            for name, runs in times.items():
                seconds = statistics.median(runs)
                overhead = (seconds - fixed - single) / rows * 1e3 if "ray" in name else float("nan")
                print(
                    f"{rows:>8} {name:<16} {seconds:>8.1f} {rows / seconds:>8.0f} {single / seconds:>14.2f}x "
                    f"{overhead:>10.3f} ms"
                )


def _one_file(corpus: Path) -> Path:
    """The corpus as one CSV (what one process reads), written once."""
    target = corpus.parent / f"{corpus.name}.csv"
    if not target.exists():
        rows = []
        for part in sorted(corpus.glob("part*.csv")):
            rows += part.read_text().splitlines()[1:]
        target.write_text("text\n" + "\n".join(rows) + "\n")
    return target


if __name__ == "__main__":
    main()
