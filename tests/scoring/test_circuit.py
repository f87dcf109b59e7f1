"""Greedy circuit extraction: fast == reference, brute force, resume, distributed, bad input."""

import json
import os
import sys
import tempfile

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.scoring import CircuitError, extract_circuit, objective_value
from hydra_ensembles.scoring.circuit import candidates as circuit_candidates
from hydra_ensembles.scoring.circuit import extract as circuit_extract
from hydra_ensembles.scoring.circuit import rescoring, search
from tests.factories import image_inputs, labelled, text_inputs, tiny_bert, tiny_vit


def _text_data():
    id_val = [labelled(text_inputs(batch=6, tokens=9, seed=s), seed=s) for s in range(3)]
    ood_val = [text_inputs(batch=5, tokens=7, seed=10 + s) for s in range(2)]
    return id_val, ood_val


def _model(**kwargs):
    return tiny_bert(layers=3, heads=4, head_dim=3, init_range=0.3, **kwargs)


def _fp32_alone_per_step(monkeypatch) -> list[bool]:
    """Filled, for each step of the extractions run after it, with whether the step scored its
    candidates in fp32 alone."""
    seen: list[bool] = []
    original = search.Extraction._logits

    def spy(self, *args):
        seen.append(self.fp32_alone)
        return original(self, *args)

    monkeypatch.setattr(search.Extraction, "_logits", spy)
    return seen


@pytest.mark.parametrize("objective", ["acc", "ood", "avg"])
def test_fast_equals_reference_bert(objective):
    model = _model()
    id_val, ood_val = _text_data()
    ref = extract_circuit(
        model, id_val, ood_val, objective=objective, budget=9, method="reference", progress=False
    )
    fast = extract_circuit(
        model, id_val, ood_val, objective=objective, budget=9, method="fast", progress=False
    )
    assert fast.removed == ref.removed
    assert fast.scores == pytest.approx(ref.scores)
    assert len(set(fast.removed)) == 9


def test_fast_equals_reference_vit_with_layer_minimum():
    model = tiny_vit(layers=2, heads=4, init_range=0.3)
    id_val = [labelled(image_inputs(batch=6, seed=s), seed=s) for s in range(2)]
    ood_val = [image_inputs(batch=5, seed=9)]
    kwargs = {"objective": "avg", "budget": 6, "min_heads_per_layer": 1, "progress": False}
    ref = extract_circuit(model, id_val, ood_val, method="reference", **kwargs)
    fast = extract_circuit(model, id_val, ood_val, method="fast", candidate_chunk=3, **kwargs)
    assert fast.removed == ref.removed
    assert all(len(k) >= 1 for k in fast.head_set().resolve([4, 4]))


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_fast_equals_reference_on_real_minilm(minilm, minilm_inputs):
    from hydra_ensembles.models import load_tokenizer

    id_val = [{**minilm_inputs, "labels": torch.tensor([0, 1, 2, 3])}]
    ood = ["Knock knock. Who is there? Lettuce.", "Mix the flour and eggs, then bake for an hour."]
    ood_val = [dict(load_tokenizer()(ood, padding=True, return_tensors="pt"))]
    kwargs = {"objective": "avg", "budget": 4, "progress": False}
    ref = extract_circuit(minilm, id_val, ood_val, method="reference", **kwargs)
    fast = extract_circuit(minilm, id_val, ood_val, **kwargs)
    assert fast.removed == ref.removed and fast.scores == pytest.approx(ref.scores)


def _score_after_pruning(model, heads, id_val, ood_val, objective):
    pruned = he.prune(model, heads)
    with torch.no_grad():
        id_logits = torch.cat(
            [pruned(**{k: v for k, v in b.items() if k != "labels"}).logits for b in id_val]
        )
        ood_logits = torch.cat([pruned(**b).logits for b in ood_val])
    labels = torch.cat([b["labels"] for b in id_val])
    return objective_value(objective, id_logits, labels, ood_logits)


def _spy_caches(monkeypatch) -> list:
    caches = []

    class Spy(circuit_candidates.SuffixCache):
        def __init__(self, *args):
            super().__init__(*args)
            self.restarts = 0
            caches.append(self)

        def start_layer(self, cand):
            start = super().start_layer(cand)
            self.restarts += start > cand[0]
            return start

    monkeypatch.setattr(circuit_extract, "SuffixCache", Spy)
    return caches


def test_suffix_reuse_restarts_candidates_above_their_layer_and_changes_nothing(monkeypatch):
    model = _model(seed=1)
    id_val, ood_val = _text_data()
    caches = _spy_caches(monkeypatch)
    kwargs = {"objective": "avg", "budget": 9, "progress": False, "precision": "fp32"}  # one cache
    reused = extract_circuit(model, id_val, ood_val, **kwargs)
    plain = extract_circuit(model, id_val, ood_val, cache_gb=0, **kwargs)
    reference = extract_circuit(model, id_val, ood_val, method="reference", **kwargs)
    assert caches[0].restarts > 0 and caches[0].enabled  # candidates resumed from stored states
    assert caches[1].restarts == 0 and not caches[1].enabled
    assert reused.removed == plain.removed == reference.removed
    assert reused.scores == pytest.approx(reference.scores)
    assert plain.scores == pytest.approx(reference.scores)


def test_suffix_cache_switches_itself_off_past_its_memory_cap(monkeypatch):
    model = _model(seed=2)
    id_val, ood_val = _text_data()
    caches = _spy_caches(monkeypatch)
    kwargs = {"objective": "avg", "budget": 6, "progress": False}
    capped = extract_circuit(model, id_val, ood_val, cache_gb=1e-6, **kwargs)  # 1 KiB: full at once
    assert not caches[0].enabled and caches[0].states == {} and caches[0].restarts == 0
    reference = extract_circuit(model, id_val, ood_val, method="reference", **kwargs)
    assert capped.removed == reference.removed and capped.scores == pytest.approx(reference.scores)


@pytest.mark.filterwarnings("ignore:fp16 requested")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_greedy_matches_brute_force_with_structural_pruning(precision):
    """In every precision the order is the fp32 brute force's: pruned models run one by one in
    fp32 (low precisions score again in fp32 whatever rounding could have reordered)."""
    model = _model(seed=3)
    id_val, ood_val = _text_data()
    order = extract_circuit(
        model, id_val, ood_val, objective="avg", budget=2, progress=False, precision=precision
    )
    removed: list[tuple[int, int]] = []
    for step in range(2):
        options = {}
        for layer in range(3):
            for head in range(4):
                if (layer, head) in removed:
                    continue
                gone = {*removed, (layer, head)}
                heads = he.HeadSet({lay: [h for h in range(4) if (lay, h) not in gone] for lay in range(3)})
                options[(layer, head)] = _score_after_pruning(model, heads, id_val, ood_val, "avg")
        best = max(options.values())
        assert order.removed[step] in {c for c, s in options.items() if s >= best - 1e-9}
        assert order.scores[step] == pytest.approx(best)
        removed.append(order.removed[step])


def test_a_destructive_head_is_removed_first():
    model = _model(seed=5)
    inputs = [text_inputs(batch=6, tokens=9, seed=s) for s in range(3)]
    without = he.HeadSet({1: [0, 1, 3]})
    with torch.no_grad(), he.ablate(model, without):  # labels: what the model says without (1, 2)
        id_val = [{**x, "labels": model(**x).logits.argmax(-1)} for x in inputs]
    with torch.no_grad():  # by construction: head 2 of layer 1 now swamps the residual stream
        model.bert.encoder.layer[1].attention.output.dense.weight[:, 6:9] *= 1e4
    order = extract_circuit(model, id_val, None, objective="acc", budget=1, progress=False)
    assert order.removed == [(1, 2)]
    assert order.scores[0] == 1.0 > order.base_score


def test_head_set_for_any_budget_and_json_round_trip(tmp_path):
    model = _model()
    id_val, ood_val = _text_data()
    order = extract_circuit(model, id_val, ood_val, objective="ood", budget=4, progress=False)
    assert order.head_set(0) == he.HeadSet.full([4, 4, 4])
    assert order.head_set(4).num_kept([4, 4, 4]) == 8
    path = order.save(tmp_path / "order.json")
    assert he.CircuitOrder.load(path) == order
    with pytest.raises(CircuitError, match="num_pruned"):
        order.head_set(5)


@pytest.mark.parametrize(("precision", "method"), [("fp32", "fast"), ("bf16", "fast"), ("bf16", "lazy")])
def test_resume_after_interruption_gives_the_same_result(tmp_path, monkeypatch, precision, method):
    """Also in bf16, where the checkpoint carries the largest logit error seen so far and whether
    the steps left score in fp32 alone (with the lazy method's last known scores, fp32's since)."""
    model = _model()
    id_val, ood_val = _text_data()
    args = (model, id_val, ood_val)
    settings = {"budget": 5, "progress": False, "precision": precision, "method": method, "shortlist": 3}
    kwargs = {**settings, "checkpoint": tmp_path / "circuit.json"}
    full = extract_circuit(*args, objective="avg", **settings)
    checkpoint = tmp_path / "circuit.json"
    calls = {"n": 0}
    original = circuit_candidates.evaluate_fast

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(circuit_candidates, "evaluate_fast", interrupted)
    with pytest.raises(KeyboardInterrupt):
        extract_circuit(*args, objective="avg", **kwargs)
    saved = json.loads(checkpoint.read_text())
    assert 1 <= len(saved["order"]["removed"]) <= 2
    # bf16 rescored most candidates of the first step: the steps left are fp32's alone
    assert saved.get("fp32_alone") is (True if precision == "bf16" else None)
    monkeypatch.setattr(circuit_candidates, "evaluate_fast", original)
    fp32_alone = _fp32_alone_per_step(monkeypatch)  # of the resumed steps
    resumed = extract_circuit(*args, objective="avg", **kwargs)
    assert resumed == full
    assert fp32_alone == [precision == "bf16"] * (5 - len(saved["order"]["removed"]))
    with pytest.raises(CircuitError, match="another extraction"):
        extract_circuit(*args, objective="acc", **kwargs)


def test_lazy_mode_with_a_full_shortlist_is_exact_and_records_its_settings():
    model = _model()
    id_val, ood_val = _text_data()
    exact = extract_circuit(model, id_val, ood_val, objective="avg", budget=8, progress=False)
    lazy = extract_circuit(
        model, id_val, ood_val, objective="avg", budget=8, method="lazy", shortlist=12, progress=False
    )
    assert lazy.removed == exact.removed and lazy.scores == pytest.approx(exact.scores)
    assert exact.approximation is None
    assert lazy.approximation == {"method": "lazy", "shortlist": 12, "refresh_every": 8}
    assert he.CircuitOrder.from_dict(lazy.to_dict()) == lazy


def test_lazy_mode_evaluates_only_its_shortlist_and_resumes_identically(tmp_path, monkeypatch):
    model = _model()
    id_val, ood_val = _text_data()
    evaluated: list[int] = []
    original = circuit_candidates.evaluate_fast

    def counting(model, adapter, masks, candidates, *args):
        evaluated.append(len(candidates))
        return original(model, adapter, masks, candidates, *args)

    monkeypatch.setattr(circuit_candidates, "evaluate_fast", counting)
    kwargs = {"objective": "avg", "budget": 6, "method": "lazy", "shortlist": 3, "refresh_every": 4}
    kwargs["precision"] = "fp32"  # counts the evaluations of one precision
    full = extract_circuit(model, id_val, ood_val, progress=False, **kwargs)
    assert evaluated == [12, 3, 3, 3, 8, 3]  # full, 3 shortlisted, full refresh at step 5, ...
    assert len(set(full.removed)) == 6 and all(s == s for s in full.scores)

    calls = {"n": 0}

    def interrupted(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args)

    checkpoint = tmp_path / "lazy.json"
    monkeypatch.setattr(circuit_candidates, "evaluate_fast", interrupted)
    with pytest.raises(KeyboardInterrupt):
        extract_circuit(model, id_val, ood_val, checkpoint=checkpoint, progress=False, **kwargs)
    monkeypatch.setattr(circuit_candidates, "evaluate_fast", original)
    resumed = extract_circuit(model, id_val, ood_val, checkpoint=checkpoint, progress=False, **kwargs)
    assert resumed == full
    with pytest.raises(CircuitError, match="another extraction"):  # exact runs never reuse lazy state
        extract_circuit(
            model, id_val, ood_val, objective="avg", budget=6, checkpoint=checkpoint, progress=False
        )


@pytest.mark.filterwarnings("ignore:fp16 requested")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
# one seed in the README's test command, the three in CI's slow run
@pytest.mark.parametrize(
    "seed", [pytest.param(0, marks=pytest.mark.slow), 3, pytest.param(7, marks=pytest.mark.slow)]
)
def test_low_precision_gives_the_fp32_order(precision, seed, monkeypatch):
    """The order does not depend on the arithmetic: a bf16 or fp16 extraction removes the heads
    fp32 removes, with fp32's scores, and scores again in fp32 only what rounding could reorder."""
    model = _model(seed=seed)
    id_val, ood_val = _text_data()
    kwargs = {"budget": 9, "progress": False}
    exact = extract_circuit(model, id_val, ood_val, objective="avg", precision="fp32", **kwargs)
    rescorers = []
    original = circuit_extract.ExactRescoring

    class Spy(original):
        def __init__(self, *args):
            super().__init__(*args)
            rescorers.append(self)

    monkeypatch.setattr(circuit_extract, "ExactRescoring", Spy)
    low = extract_circuit(model, id_val, ood_val, objective="avg", precision=precision, **kwargs)
    assert low.removed == exact.removed and low.scores == exact.scores
    assert low.base_score == exact.base_score
    (rescorer,) = rescorers
    assert rescorer.error > 0 and rescorer.rescored > 0  # rounding was seen, and fp32 decided
    assert rescorer.model.training is False and model.training is False
    reference = extract_circuit(
        model, id_val, ood_val, objective="acc", precision=precision, method="reference", **kwargs
    )
    assert (
        reference.removed
        == extract_circuit(model, id_val, ood_val, objective="acc", precision="fp32", **kwargs).removed
    )


@pytest.mark.filterwarnings("ignore:fp16 requested")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_once_a_step_rescores_most_candidates_fp32_alone_gives_the_same_order(precision, monkeypatch):
    """The steps after one that scored again in fp32 most of its candidates run in fp32 alone:
    the same order and scores as rescoring at every step."""
    model = _model()
    id_val, ood_val = _text_data()
    kwargs = {"objective": "ood", "budget": 9, "precision": precision, "progress": False}
    fp32_alone = _fp32_alone_per_step(monkeypatch)
    switched = extract_circuit(model, id_val, ood_val, **kwargs)
    assert fp32_alone == [False] + [True] * 8  # the first step rescored most of its 12 candidates
    fp32_alone.clear()
    monkeypatch.setattr(rescoring, "MOST", 1.0)  # never
    rescored = extract_circuit(model, id_val, ood_val, **kwargs)
    assert fp32_alone == [False] * 9
    assert switched == rescored


def test_objective_bounds_contain_every_nearby_score():
    """`objective_bounds` holds S of any logits within the error, for every objective."""
    from hydra_ensembles.scoring.circuit import objective_bounds

    generator = torch.Generator().manual_seed(0)
    id_logits, ood_logits = torch.randn(40, 3, generator=generator), torch.randn(30, 3, generator=generator)
    labels = torch.randint(0, 3, (40,), generator=generator)
    error = 0.05
    for objective in ("acc", "ood", "avg"):
        low, high = objective_bounds(objective, id_logits, labels, ood_logits, error)
        assert low <= objective_value(objective, id_logits, labels, ood_logits) <= high
        for _ in range(50):
            noise = [
                (torch.rand(x.shape, generator=generator) * 2 - 1) * error for x in (id_logits, ood_logits)
            ]
            s = objective_value(objective, id_logits + noise[0], labels, ood_logits + noise[1])
            assert low - 1e-12 <= s <= high + 1e-12
        exact = objective_value(objective, id_logits, labels, ood_logits)
        assert objective_bounds(objective, id_logits, labels, ood_logits, 0.0) == pytest.approx(
            (exact, exact)
        )


def test_deterministic():
    model = _model()
    id_val, ood_val = _text_data()
    runs = [extract_circuit(model, id_val, ood_val, budget=3, progress=False) for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget": 13}, "budget 13 out of range"),
        ({"budget": 9, "min_heads_per_layer": 2}, "at most 6"),
        ({"min_heads_per_layer": 5}, "impossible"),
        ({"objective": "ood", "ood_val": None}, "needs OOD validation data"),
        ({"id_val": []}, "id_val is empty"),
        ({"ood_val": []}, "ood_val is empty"),
        ({"id_val": [text_inputs()]}, "needs 'labels'"),
        ({"id_val": [{**text_inputs(), "labels": torch.tensor([0, 1, 2, 9])}]}, "labels out of range"),
        ({"objective": "loss"}, "objective must be"),
        ({"method": "lazy", "shortlist": 0}, "shortlist >= 1"),
        ({"method": "greedy"}, "method must be"),
    ],
)
def test_bad_input(kwargs, message):
    id_val, ood_val = _text_data()
    args = {"id_val": id_val, "ood_val": ood_val, "budget": 2, "progress": False, **kwargs}
    with pytest.raises(CircuitError, match=message):
        extract_circuit(_model(), **args)


def test_refuses_a_pruned_model():
    id_val, ood_val = _text_data()
    with pytest.raises(CircuitError, match="unpruned"):
        extract_circuit(he.prune(_model(), he.HeadSet({0: [0]})), id_val, ood_val, budget=1, progress=False)


WORKER = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tests.factories import tiny_bert, labelled, text_inputs
from hydra_ensembles.scoring import extract_circuit
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2)
torch.set_num_threads(1)
model = tiny_bert(layers=3, heads=4, head_dim=3, init_range=0.3)
id_val = [labelled(text_inputs(batch=6, tokens=9, seed=s), seed=s) for s in range(3)]
ood_val = [text_inputs(batch=5, tokens=7, seed=10 + s) for s in range(2)]
order = extract_circuit(model, id_val, ood_val, objective="avg", budget=5, progress=False)
json.dump(order.to_dict(), open({out!r} + str(rank), "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow  # two torch.distributed processes (8 s): CI's slow run
def test_two_process_extraction_matches_one_process(tmp_path):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    store = tempfile.mktemp(dir=tmp_path)
    out = str(tmp_path / "order")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=root, store=store, out=out))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)]) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    single = extract_circuit(_model(), *_text_data(), objective="avg", budget=5, progress=False)
    for rank in range(2):
        with open(out + str(rank)) as handle:
            assert he.CircuitOrder.from_dict(json.load(handle)) == single
