"""Taylor scores against a direct autograd computation; prune -> recompute; bad input."""

import pytest
import torch
import torch.nn.functional as F

import hydra_ensembles as he
from tests.factories import labelled, text_inputs, tiny_bert


def _calib(n=3):
    return [labelled(text_inputs(batch=4, tokens=7, seed=s), seed=s) for s in range(n)]


def test_scores_match_direct_autograd():
    model = tiny_bert(layers=2, heads=4, head_dim=3, init_range=0.2)
    calib = _calib()
    scores = he.taylor_scores(model, calib, precision="fp32")  # the formula, against fp32 autograd
    adapter = he.get_adapter(model)
    blocks = [adapter.attention_block(model, layer) for layer in range(2)]
    weights = [lin.weight for b in blocks for lin in (b.query, b.key, b.value)]
    loss = sum(
        F.cross_entropy(model(**{k: v for k, v in b.items() if k != "labels"}).logits, b["labels"])
        for b in calib
    ) / len(calib)
    grads = torch.autograd.grad(loss, weights)
    for layer in range(2):
        for head in range(4):
            rows = slice(3 * head, 3 * head + 3)
            expected = (
                sum(
                    (weights[3 * layer + i][rows] * grads[3 * layer + i][rows]).abs().mean() for i in range(3)
                )
                / 3
            )
            assert scores[layer, head].item() == pytest.approx(expected.item(), rel=1e-4)
    assert all(p.grad is None for p in model.parameters())


def test_pruned_heads_score_nan_and_flags_are_restored():
    model = tiny_bert(layers=2, heads=4)
    for p in model.parameters():
        p.requires_grad_(False)
    pruned = he.prune(model, he.HeadSet({0: [1, 3]}))
    scores = he.taylor_scores(pruned, _calib(1))
    assert torch.isnan(scores[0, 0]) and torch.isnan(scores[0, 2])
    assert not torch.isnan(scores[0, 1]) and not torch.isnan(scores[1]).any()
    assert not any(p.requires_grad for p in model.parameters())


def test_layerwise_prune_then_recompute():
    model = tiny_bert(layers=3, heads=4, init_range=0.2)
    calib = _calib()
    chosen = he.taylor_head_set(model, calib, heads_per_layer=2, progress=False)
    resolved = chosen.resolve([4, 4, 4])
    assert all(len(k) == 2 for k in resolved)
    first = he.taylor_scores(model, calib, precision="fp32")[0]  # what the head set decides on
    assert set(resolved[0]) == set(torch.argsort(-first)[:2].tolist())
    after = he.taylor_scores(he.prune(model, he.HeadSet({0: list(resolved[0])})), calib, precision="fp32")[1]
    assert set(resolved[1]) == set(torch.argsort(-after)[:2].tolist())


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_the_kept_heads_do_not_depend_on_the_machines_precision(monkeypatch, scope):
    """Where `auto` resolves to bf16, the head set is still fp32's. A low-precision near-tie is
    injected (scores in any other precision swap the last kept and the first pruned head of each
    decision), so a head set decided in the machine's precision would differ."""
    from hydra_ensembles.scoring import taylor

    monkeypatch.setenv("HYDRA_PRECISION", "bf16")
    model, calib = tiny_bert(layers=2, heads=4, init_range=0.2), _calib()
    expected = he.taylor_head_set(model, calib, heads_per_layer=2, scope=scope, progress=False)
    exact = taylor.taylor_scores

    def near_tie(model, calib, progress=False, precision="auto"):
        scores = exact(model, calib, progress, precision)
        if precision == "fp32":
            return scores
        rows = scores.flatten()[None] if scope == "global" else scores  # what one decision ranks
        swapped = rows.clone()
        for row, out in zip(rows, swapped, strict=True):
            order = torch.argsort(-row.nan_to_num(float("-inf")), stable=True)
            cut = 4 if scope == "global" else 2  # the heads kept
            out[order[cut - 1]], out[order[cut]] = row[order[cut]], row[order[cut - 1]]
        return swapped.view_as(scores)

    monkeypatch.setattr(taylor, "taylor_scores", near_tie)
    assert he.taylor_head_set(model, calib, heads_per_layer=2, scope=scope, progress=False) == expected


def test_global_scope_keeps_the_top_heads_overall():
    model = tiny_bert(layers=2, heads=4, init_range=0.2)
    calib = _calib()
    chosen = he.taylor_head_set(model, calib, heads_per_layer=2, scope="global", progress=False)
    scores = he.taylor_scores(model, calib, precision="fp32")
    top = set(map(tuple, torch.nonzero(scores >= scores.flatten().sort(descending=True).values[3]).tolist()))
    kept = {(lay, h) for lay, heads in enumerate(chosen.resolve([4, 4])) for h in heads}
    assert kept == top and len(kept) == 4


def test_bad_input():
    model = tiny_bert(layers=2, heads=4)
    with pytest.raises(ValueError, match="calib is empty"):
        he.taylor_scores(model, [])
    with pytest.raises(ValueError, match="needs 'labels'"):
        he.taylor_scores(model, [text_inputs()])
    with pytest.raises(ValueError, match="labels out of range"):
        he.taylor_scores(model, [{**text_inputs(), "labels": torch.tensor([0, 1, 2, 7])}])
    with pytest.raises(he.HeadSetError, match="heads_per_layer"):
        he.taylor_head_set(model, _calib(1), heads_per_layer=5)


def test_a_model_with_non_finite_weights_is_not_ranked():
    """Every score of a model with an Inf weight would be meaningless (every circuit score 0.5)."""
    model = tiny_bert(layers=2, heads=2)
    with torch.no_grad():
        model.bert.encoder.layer[1].attention.self.value.weight[0, 0] = float("inf")
    batches = [labelled(text_inputs(batch=4, tokens=5))]
    with pytest.raises(ValueError, match="NaN or Inf"):
        he.taylor_scores(model, batches)
    with pytest.raises(ValueError, match="NaN or Inf"):  # a CircuitError
        he.extract_circuit(model, batches, budget=1, objective="acc")
