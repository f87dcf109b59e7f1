"""Running a model in pieces: captured layer inputs, running from a layer, replaying attention."""

import torch

from hydra_ensembles import get_adapter
from hydra_ensembles.batching import repeat_rows
from hydra_ensembles.scoring.forward import capture_layer_inputs, replaying_core, run_from_layer
from tests.factories import image_inputs, text_inputs, tiny_bert, tiny_vit


def test_running_from_any_layer_with_replayed_attention_gives_the_full_logits():
    model = tiny_bert(layers=3, heads=4, head_dim=3, init_range=0.3).eval()
    adapter = get_adapter(model)
    inputs = text_inputs(batch=4, tokens=7, seed=1)
    hidden, logits, contexts, _ = capture_layer_inputs(model, adapter, inputs)
    assert len(hidden) == len(contexts) == 3 and all(c.shape == (4, 7, 12) for c in contexts)
    for layer in range(3):
        stacked = hidden[layer].repeat(2, 1, 1)
        plain = run_from_layer(model, adapter, layer, stacked, inputs)
        core = adapter.attention_core_path(layer)
        with replaying_core(model, core, contexts[layer].repeat(2, 1, 1)):
            replayed = run_from_layer(model, adapter, layer, stacked, inputs)
        # the replay stands in for Q/K/V + attention: prove it by corrupting the real module
        with torch.no_grad():
            model.get_submodule(core).query.weight.mul_(-1)
            with replaying_core(model, core, contexts[layer].repeat(2, 1, 1)):
                still = run_from_layer(model, adapter, layer, stacked, inputs)
            model.get_submodule(core).query.weight.mul_(-1)
        torch.testing.assert_close(plain, logits.repeat(2, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(replayed, plain, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(still, plain, rtol=1e-5, atol=1e-6)
    assert type(model.get_submodule(adapter.attention_core_path(0))).__name__ == "BertSelfAttention"
    assert "forward" not in vars(model.bert.embeddings)  # the embeddings compute again afterwards
    torch.testing.assert_close(model(**inputs).logits, logits)


def test_running_from_a_layer_skips_the_embeddings():
    model = tiny_bert(layers=2, heads=4, head_dim=3).eval()
    adapter = get_adapter(model)
    inputs = text_inputs(batch=2, tokens=5, seed=3)
    hidden, logits, _, _ = capture_layer_inputs(model, adapter, inputs)
    calls = []
    probe = model.bert.embeddings.word_embeddings.register_forward_hook(lambda *_: calls.append(1))
    out = run_from_layer(model, adapter, 1, hidden[1], inputs)
    probe.remove()
    assert calls == [] and torch.allclose(out, logits, rtol=1e-5, atol=1e-6)


def test_vit_has_no_core_and_still_runs_from_layers():
    model = tiny_vit(layers=2, heads=4).eval()
    adapter = get_adapter(model)
    inputs = image_inputs(batch=3, seed=2)
    hidden, logits, contexts, _ = capture_layer_inputs(model, adapter, inputs)
    assert contexts == [None, None] and adapter.attention_core_path(0) is None
    with replaying_core(model, None, None):
        out = run_from_layer(model, adapter, 1, hidden[1].repeat(3, 1, 1), inputs)
    torch.testing.assert_close(out, logits.repeat(3, 1), rtol=1e-5, atol=1e-6)
    assert repeat_rows(inputs, 3)["pixel_values"].shape[0] == 9
