"""Parameter counts of the fused model equal their closed-form formulas; multiply-adds are counted."""

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.cost import count_parameters, measure, multiply_adds, percentile
from tests.factories import text_inputs, tiny_bert


def _layer_matrix_parameters(model, layer: int) -> int:
    """Weights (no biases, no norms) of one layer: attention projections and MLP."""
    block = he.get_adapter(model).layers(model)[layer]
    total = 0
    for module in block.modules():
        if isinstance(module, he.layers.FusedMultiHeadAttention):
            total += 4 * sum(module.heads_per_member) * module.head_dim * module.hidden_size
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel()
    return total


@pytest.mark.parametrize(("heads", "keep", "members"), [(4, 2, 3), (6, 4, 2), (8, 8, 1), (8, 3, 5)])
def test_parameters_per_layer_match_the_formulas(heads, keep, members):
    d = heads * 4
    model = tiny_bert(layers=2, heads=heads, head_dim=4, intermediate=4 * d)
    head_sets = [
        he.HeadSet({layer: [(m + i) % heads for i in range(keep)] for layer in range(2)})
        for m in range(members)
    ]
    hydra = he.fuse(model, head_sets)
    for layer in range(2):
        assert _layer_matrix_parameters(model, layer) == 12 * d * d  # single
        assert _layer_matrix_parameters(hydra.model, layer) == 4 * members * keep / heads * d * d + 8 * d * d


def test_effective_parameter_count_ignores_padding():
    model = tiny_bert(layers=1, heads=4, head_dim=3)
    ragged = he.fuse(model, [he.HeadSet({0: [0]}), he.HeadSet({0: [0, 1, 2, 3]})])
    single = count_parameters(model)
    attention_single = 4 * 12 * 12 + 4 * 12
    kept = 5 * 3  # 5 heads x head_dim 3 in total
    expected = single - attention_single + 4 * kept * 12 + 3 * kept + 2 * 12
    assert count_parameters(ragged) == expected
    assert ragged.num_parameters(effective=False) > expected  # padded storage


def test_multiply_adds_scale_with_members():
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    x = text_inputs(batch=2, tokens=8, padded=False)
    head_sets = [he.HeadSet({0: [0, 1], 1: [2, 3]})] * 3
    hydra = he.fuse(model, head_sets, shared_trunk=False).eval()
    members = [he.prune(model, hs).eval() for hs in head_sets]
    fused = multiply_adds(lambda: hydra(**x))
    sequential = multiply_adds(lambda: [m(**x) for m in members])
    assert fused == sequential > multiply_adds(lambda: model(**x)) > 0
    trunk = he.fuse(model, head_sets).eval()  # identical members: layer 0 runs once
    assert trunk.trunk_layers == 1 and multiply_adds(lambda: trunk(**x)) < fused


def test_measure_reports_every_run_side_by_side():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    runs = {"a": lambda: layer(x), "b": lambda: layer(torch.cat([x, x]))}
    measured = measure(runs, repeats=3, warmup=0)
    assert set(measured) == {"a", "b"}
    for name, cost in measured.items():
        assert 0 < cost["median_ms"] <= cost["p90_ms"]
        assert cost["gmacs"] == multiply_adds(runs[name]) / 1e9
    assert measured["b"]["gmacs"] == 2 * measured["a"]["gmacs"] == 2 * 3 * 8 * 4 / 1e9
    assert "gmacs" not in measure(runs, repeats=1, warmup=0, count_macs=False)["a"]


def test_percentile_is_the_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 0.9) == 5 and percentile([5, 1, 3, 2, 4], 0.5) == 3
    assert percentile([7.0], 0.9) == 7.0
