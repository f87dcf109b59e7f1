"""MIMO against explicit computation: the mixed input layer is the sum of per-input layers, M
copies of one input start as the base model, the heads are answered member-stacked; training
batches mix items as specified; training and save/load."""

import pytest
import torch

from hydra_ensembles.baselines import mimo, mimo_members, train_mimo
from hydra_ensembles.baselines.mimo import mimo_batches
from hydra_ensembles.evaluation import predict
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import PARTS, FineTuneConfig
from tests.factories import FAMILIES, PRECISIONS, computing_in, labelled, rounding_tolerance

MIMO_FAMILIES = ["bert", "roberta", "distilbert", "electra", "vit", "deit", "dinov2", "clip"]


def _head_input(model, x):
    """What the base model's task head reads for inputs x (captured by a hook)."""
    seen = {}
    module = model.classifier
    final = module if isinstance(module, torch.nn.Linear) else module.out_proj
    handle = final.register_forward_hook(lambda _m, args, _o: seen.update(x=args[0]))
    with torch.no_grad():
        model(**x)
    handle.remove()
    return seen["x"], final


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", MIMO_FAMILIES)
def test_copies_of_one_input_give_the_base_features_to_every_head(family, precision):
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    multi = mimo(model, 3, seed=2).eval()
    assert mimo_members(multi) == 3 and mimo_members(model) == 1
    x = inputs(batch=4)
    preds = predict(multi, [labelled(x)], progress=False, precision=precision)
    assert preds.member_logits.shape == (3, 4, 3)
    with computing_in(precision):
        features, _ = _head_input(model, x)
        wide, final = _head_input(multi, x)
        tol = rounding_tolerance(precision, features, layers=2, fp32=1e-5)
        assert (features.float() - wide.float()).abs().max() <= tol  # at the start, M copies of x == x
        with torch.no_grad():
            expected = torch.nn.functional.linear(features, final.weight, final.bias).float()
    expected = expected.reshape(4, 3, 3).transpose(0, 1)
    tol = rounding_tolerance(precision, expected, layers=2, fp32=1e-5 * max(1.0, expected.abs().max().item()))
    assert (torch.as_tensor(preds.member_logits) - expected).abs().max() <= tol
    assert not torch.allclose(expected[0], expected[1])  # three heads, three initialisations


def test_image_input_layer_is_the_sum_of_per_input_layers():
    factory, inputs = FAMILIES["dinov2"]
    multi = mimo(factory(layers=1, heads=2, head_dim=3), 2).eval()
    conv = multi.dinov2.embeddings.patch_embeddings.projection
    with torch.no_grad():
        conv.weight.normal_()  # per-input weights apart, as after training
    a, b = inputs(batch=2, seed=0)["pixel_values"], inputs(batch=2, seed=1)["pixel_values"]
    stacked = torch.stack([a, b], dim=1)  # (B, M, C, H, W)
    c = a.shape[1]
    expected = torch.nn.functional.conv2d(
        a, conv.weight[:, :c], None, conv.stride
    ) + torch.nn.functional.conv2d(b, conv.weight[:, c:], conv.bias, conv.stride)
    with torch.no_grad():
        assert torch.allclose(conv(stacked.flatten(1, 2)), expected, atol=1e-5)
        mixed = multi(pixel_values=stacked).logits
        swapped = multi(pixel_values=stacked.flip(1)).logits
    assert not torch.allclose(mixed, swapped)  # the members can tell their inputs apart


def test_text_inputs_are_mapped_per_input_and_summed():
    factory, inputs = FAMILIES["bert"]
    multi = mimo(factory(layers=1, heads=2, head_dim=3), 2).eval()
    with torch.no_grad():
        multi.mimo_inputs.weight.normal_()
    x, y = inputs(batch=2, seed=0), inputs(batch=2, seed=1)
    ids = torch.stack([x["input_ids"], y["input_ids"]], dim=1)
    words = multi.get_input_embeddings()
    w = multi.mimo_inputs.weight
    expected = words(x["input_ids"]) @ w[0].T + words(y["input_ids"]) @ w[1].T  # weights (out, in)
    mask = torch.stack([x["attention_mask"], y["attention_mask"]], dim=1)
    captured = {}
    handle = multi.bert.embeddings.register_forward_pre_hook(
        lambda _m, a, k: captured.update(k), with_kwargs=True
    )
    with torch.no_grad():
        multi(input_ids=ids, attention_mask=mask)
    handle.remove()
    assert torch.allclose(captured["inputs_embeds"], expected, atol=1e-5)


def test_mixed_batches_follow_batch_and_input_repetition():
    batch = {"pixel_values": torch.arange(8.0).reshape(8, 1), "labels": torch.arange(8)}
    mixed = mimo_batches([batch], 3, rho=0.5, batch_repeat=4, seed=0)[0]
    assert mixed["pixel_values"].shape == (32, 3, 1) and mixed["labels"].shape == (32, 3)
    labels = mixed["labels"]
    assert torch.equal(mixed["pixel_values"][..., 0].long(), labels)  # inputs and labels travel together
    assert torch.equal(labels[:, 0], torch.arange(8).repeat(4))
    shuffled = mimo_batches([batch], 3, rho=0.0, batch_repeat=4, seed=0)[0]["labels"]
    for m in range(3):  # without input repetition every member reads each item batch_repeat times
        assert torch.equal(shuffled[:, m].sort().values, torch.arange(8).repeat_interleave(4))
    same = (labels == labels[:, :1]).all(1).float().mean()
    assert 0.3 < same < 0.8  # about rho of the rows repeat one input (plus chance matches)
    assert (mimo_batches([batch], 3, rho=1.0, seed=0)[0]["labels"] == labels[:, :1]).all()


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_training_and_round_trip(tmp_path, family):
    factory, inputs = FAMILIES[family]
    multi = mimo(factory(layers=2, heads=4, head_dim=3), 2)
    data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(2)]
    before = {n: p.clone() for n, p in multi.named_parameters()}
    config = FineTuneConfig(epochs=2, lr=1e-2, precision="fp32", warmup=0.0, trainable=PARTS)
    train_mimo(multi, data, config, batch_repeat=2, progress=False)
    moved = {n for n, p in multi.named_parameters() if not torch.equal(p, before[n])}
    assert any("classifier" in n for n in moved) and any("embeddings" in n or "mimo" in n for n in moved)
    save_member(multi, tmp_path / "mimo")
    loaded = load_member(tmp_path / "mimo")
    assert mimo_members(loaded) == 2
    x = inputs(batch=3)
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, multi.eval()(**x).logits)
    with pytest.raises(ValueError, match="already"):
        mimo(multi, 2)
