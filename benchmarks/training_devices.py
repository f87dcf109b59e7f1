"""Fine-tuning and greedy circuit extraction on a GPU against the CPU of the same machine.

The text demo's shapes: a model of MiniLM-L6's size (``--model``; random weights are fine, time
does not depend on their values), ``--train`` random training texts of ``--tokens`` tokens in
batches of 16 for one epoch (the demo trains 3 epochs, members 1), and circuit extraction over
``--items`` ID and OOD validation texts of ``--circuit-tokens`` tokens removing ``--budget``
heads. Each device runs in its own process (Accelerate chooses its device once per process);
fine-tuning runs in the precision ``auto`` picks there. Prints one line per device and stage,
then the GPU's speed-up over the CPU.

    python benchmarks/training_devices.py --model MODEL [--devices cpu,cuda] [--budget 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def _batches(vocab: int, rows: int, tokens: int, batch: int, classes: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (rows, tokens), generator=g)
    labels = torch.randint(0, classes, (rows,), generator=g)
    return [
        {"input_ids": ids[i : i + batch], "attention_mask": torch.ones_like(ids[i : i + batch]),
         "labels": labels[i : i + batch]}
        for i in range(0, rows, batch)
    ]  # fmt: skip


def _one_device(args: argparse.Namespace) -> dict:
    from hydra_ensembles.models import load_classifier
    from hydra_ensembles.precision import resolve_precision
    from hydra_ensembles.scoring import extract_circuit
    from hydra_ensembles.training import FineTuneConfig, fine_tune

    device = torch.device(args.run)
    model = load_classifier(args.model, num_labels=4)
    vocab = model.config.vocab_size
    train = _batches(vocab, args.train, args.tokens, 16, 4, seed=0)
    started = time.perf_counter()
    fine_tune(model, train, None, FineTuneConfig(epochs=1, warmup=0.0), progress=False)
    tuned = time.perf_counter() - started
    precision = resolve_precision("auto", device)
    model = model.to(device).eval()
    move = lambda batches: [{k: v.to(device) for k, v in b.items()} for b in batches]  # noqa: E731
    id_val = move(_batches(vocab, args.items, args.circuit_tokens, 16, 4, seed=1))
    ood_val = move([{k: v for k, v in b.items() if k != "labels"}
                    for b in _batches(vocab, args.items, args.circuit_tokens, 16, 4, seed=2)])  # fmt: skip
    started = time.perf_counter()
    extract_circuit(model, id_val, ood_val, budget=args.budget, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    circuit = time.perf_counter() - started
    return {"device": str(device), "precision": precision.name, "fine_tune_s": tuned, "circuit_s": circuit}


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--devices", default="cpu,cuda")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--circuit-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(_one_device(args)))
        return
    results = {}
    for device in args.devices.split(","):
        env = dict(os.environ)
        if device == "cpu":
            env["ACCELERATE_USE_CPU"] = "1"
        else:
            env.pop("ACCELERATE_USE_CPU", None)
        done = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--run", device],
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(f"{device}: failed\n{done.stderr[-2000:]}")
            continue
        results[device] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[device]
        times = f"fine-tune {r['fine_tune_s']:.1f} s, circuit {r['circuit_s']:.1f} s"
        print(f"{device} ({r['precision']}): {times}")
    if {"cpu", "cuda"} <= set(results):
        cpu, gpu = results["cpu"], results["cuda"]
        print(
            f"GPU speed-up: fine-tune {cpu['fine_tune_s'] / gpu['fine_tune_s']:.1f}x, "
            f"circuit {cpu['circuit_s'] / gpu['circuit_s']:.1f}x"
        )


if __name__ == "__main__":
    main()
