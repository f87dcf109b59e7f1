"""What makes ModernBERT different: Q, K and V packed in one linear (a pruned layer keeps each
kept head's rows of all three; Taylor scores read the packed weight's gradient), rotary
embeddings, local layers whose window is shorter than the inputs, [CLS] or masked-mean pooling."""

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.layers import FusedQKVAttention
from tests.factories import labelled, text_inputs, tiny_modernbert

TOL = 1e-4


def _model(pooling: str = "mean", seed: int = 0, **fields):
    model = tiny_modernbert(layers=3, heads=4, head_dim=4, init_range=0.3, seed=seed, pooling=pooling)
    for name, value in fields.items():
        setattr(model.config, name, value)
    return model


def _logits(models, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([m.eval()(**inputs).logits for m in models])


def test_a_pruned_layer_keeps_its_heads_rows_of_q_k_and_v():
    model = _model()
    pruned = he.prune(model, he.HeadSet({1: [0, 3]}))
    original, packed = model.model.layers[1].attn.Wqkv.weight, pruned.model.layers[1].attn.Wqkv.weight
    heads = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])  # heads 0 and 3 of one of Q, K, V
    assert torch.equal(packed, torch.cat([original[heads + 16 * i] for i in range(3)]))
    assert torch.equal(pruned.model.layers[1].attn.Wo.weight, model.model.layers[1].attn.Wo.weight[:, heads])


def test_local_windows_are_seen_by_pruned_and_fused_models():
    model = _model()
    assert model.config.layer_types[1] == "sliding_attention"
    x = text_inputs(3, tokens=9, padded=False)
    wide = tiny_modernbert(layers=3, heads=4, head_dim=4, init_range=0.3, pooling="mean")
    wide.config.sliding_window = 64  # the same weights, a window wider than the inputs
    assert (_logits([model], x) - _logits([wide], x)).abs().max() > 1e-3
    heads = [he.HeadSet({0: [1, 2], 1: [0, 3]}), he.HeadSet({1: [1], 2: [2, 3]})]
    with torch.no_grad():
        out = he.fuse(model, heads).eval()(**x).member_logits
    assert (out - _logits([he.prune(model, hs) for hs in heads], x)).abs().max().item() <= TOL
    assert any(isinstance(m, FusedQKVAttention) for m in he.fuse(model, heads).modules())


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_fine_tuned_members_fuse_exactly_with_either_pooling(pooling):
    model = _model(pooling)
    head_sets = [he.HeadSet({0: [0], 2: []}), he.HeadSet({0: [1, 2, 3], 1: [2]})]
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():
        for i, member in enumerate(members):
            for p in member.parameters():
                p.add_(0.02 * (i + 1))
    hydra = he.fuse(members, mlp="exact").eval()
    x = text_inputs(4)
    with torch.no_grad():
        assert (hydra(**x).member_logits - _logits(members, x)).abs().max().item() <= TOL
    assert hydra.num_parameters() == sum(p.numel() for m in members for p in m.parameters())


def test_taylor_scores_read_the_packed_weights_gradient():
    model = _model()
    batch = labelled(text_inputs(6, seed=2), seed=2)
    scores = he.taylor_scores(model, [batch], precision="fp32")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = torch.nn.functional.cross_entropy(model(**inputs).logits, batch["labels"])
    packed = model.model.layers[2].attn.Wqkv.weight
    (grad,) = torch.autograd.grad(loss, [packed])
    product = (packed * grad).abs().detach()
    expected = torch.stack(
        [sum(product[16 * i + 4 * h : 16 * i + 4 * h + 4].mean() for i in range(3)) / 3 for h in range(4)]
    )
    assert (scores[2] > 0).all()
    torch.testing.assert_close(scores[2], expected, rtol=1e-5, atol=1e-9)


def test_the_curvature_analysis_refuses_packed_projections():
    from hydra_ensembles.analysis import attention_parameters

    with pytest.raises(NotImplementedError, match="ModernBERT packs them"):
        attention_parameters(_model())
