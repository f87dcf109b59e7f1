"""A small end-to-end run on the embedded default: real MiniLM-L6, real BBC News, 3 members, fused.

This is the foundation's demo: the base model's classifier is fit as a linear probe, three
members keep 8 of 12 heads per layer chosen at random with fixed seeds (Taylor and circuit
selection come with the member-building tools), and the fused model is checked against the
members run one by one.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .cost import interleaved_latency, median
from .data import batches, load_bbc_news, split_indices, stable_sample
from .fusion import HydraModel, fuse, load_hydra
from .heads import HeadSet
from .models import DEFAULT_TEXT_MODEL, load_classifier, load_tokenizer
from .surgery import prune
from .training import fit_linear_head

ID_TOPICS = ("business", "entertainment", "politics", "sports")
SPLITS = {"train": 0.6, "val": 0.2, "test": 0.2}


@dataclass
class QuickDemoConfig:
    model: str = DEFAULT_TEXT_MODEL
    num_members: int = 3
    heads_kept: int = 8
    max_length: int = 64
    batch_size: int = 32
    train_limit: int | None = 600
    test_limit: int | None = None
    seed: int = 0
    out_dir: Path = Path("runs/demo")


def random_members(num_members: int, layers: int, heads: int, keep: int, seed: int) -> list[HeadSet]:
    """Head sets keeping ``keep`` random heads per layer, one seed per member."""
    return [
        HeadSet(
            {
                layer: random.Random(seed * 1000 + m * 100 + layer).sample(range(heads), keep)
                for layer in range(layers)
            }
        )
        for m in range(num_members)
    ]


@torch.no_grad()
def _logits(model, loader, desc: str) -> torch.Tensor:
    out = []
    for batch in tqdm(loader, desc=desc, leave=False, disable=None):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        result = model(**inputs)
        out.append(result.member_logits if isinstance(model, HydraModel) else result.logits)
    return torch.cat(out, dim=-2).float()


def _scores(probs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    acc = (probs.argmax(-1) == labels).float().mean().item()
    nll = F.nll_loss(probs.clamp_min(1e-12).log(), labels).item()
    return acc, nll


def run_quick_demo(config: QuickDemoConfig) -> dict:
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    data = load_bbc_news(ID_TOPICS)
    parts = split_indices(data.ids, SPLITS, salt="bbc-news")
    train = data.subset(stable_sample(parts["train"], data.ids, config.train_limit, salt="train"))
    test = data.subset(stable_sample(parts["test"], data.ids, config.test_limit, salt="test"))
    print(
        f"data: BBC News, {len(data.classes)} topics {list(data.classes)}; train {len(train)} "
        f"(of {len(parts['train'])}), test {len(test)}; {config.max_length} tokens per text"
    )
    tokenizer = load_tokenizer(config.model)
    base = load_classifier(config.model, num_labels=len(data.classes)).eval()
    fit_linear_head(base, batches(train, tokenizer, config.batch_size, config.max_length), seed=config.seed)
    layers, heads = base.config.num_hidden_layers, base.config.num_attention_heads
    head_sets = random_members(config.num_members, layers, heads, config.heads_kept, config.seed)
    members = [prune(base, hs).eval() for hs in head_sets]
    hydra = fuse(base, head_sets).eval()
    print(
        f"model: {config.model} ({layers} layers x {heads} heads), classifier fit as a linear probe; "
        f"{config.num_members} members keep {config.heads_kept}/{heads} random heads per layer "
        f"(seed {config.seed})"
    )

    labels = torch.tensor(test.labels)
    loader = list(batches(test, tokenizer, config.batch_size, config.max_length))
    single = _logits(base, loader, "single")
    explicit = torch.stack([_logits(m, loader, f"member {i}") for i, m in enumerate(members)])
    fused = _logits(hydra, loader, "fused")

    rows = [("single (all heads)", single.softmax(-1))]
    rows += [(f"member {i} (pruned)", explicit[i].softmax(-1)) for i in range(len(members))]
    rows += [("members one by one, ensembled", explicit.softmax(-1).mean(0))]
    rows += [("Hydra (fused, one pass)", fused.softmax(-1).mean(0))]
    print(f"\n{'method':34s} {'acc':>7s} {'NLL':>7s}")
    results = {}
    for name, probs in rows:
        acc, nll = _scores(probs, labels)
        results[name] = {"acc": acc, "nll": nll}
        print(f"{name:34s} {acc:7.3f} {nll:7.3f}")

    max_diff = (fused - explicit).abs().max().item()
    agree = (fused.argmax(-1) == explicit.argmax(-1)).float().mean().item()
    print(f"\nfused vs members one by one: max |logit diff| {max_diff:.2e}, argmax agreement {agree:.1%}")

    sample = loader[0]
    inputs = {k: v for k, v in sample.items() if k != "labels"}
    times = interleaved_latency(
        {
            "single": lambda: base(**inputs),
            "members": lambda: [m(**inputs) for m in members],
            "fused": lambda: hydra(**inputs),
        },
        repeats=3,
        warmup=1,
    )
    t = {k: median(v) for k, v in times.items()}
    print(
        f"latency per batch of {inputs['input_ids'].shape[0]} (fp32): single {t['single'] * 1e3:.0f} ms, "
        f"members one by one {t['members'] * 1e3:.0f} ms, fused {t['fused'] * 1e3:.0f} ms"
    )

    out = Path(config.out_dir) / "hydra"
    hydra.save_pretrained(out)
    reloaded = load_hydra(out)
    with torch.no_grad():
        same = torch.equal(reloaded(**inputs).member_logits, hydra(**inputs).member_logits)
    print(f"saved to {out} (safetensors + JSON); reloaded outputs identical: {same}")
    print(f"done in {time.perf_counter() - start:.0f} s")
    return {
        "results": results,
        "max_abs_diff": max_diff,
        "argmax_agreement": agree,
        "latency_s": t,
        "reload_identical": same,
    }
