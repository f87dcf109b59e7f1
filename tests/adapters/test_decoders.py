"""What makes decoder LLM classifiers different: grouped-query attention (a key/value head shared
by a group of query heads, removed only with its whole group), causal attention with sliding
windows, padding on either side and the last non-padding token pooled, q/k norms per member."""

import re

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.layers import IndexedKVAttention
from tests.factories import PAD, decoder_inputs, labelled, tiny_decoder

TOL = 1e-4


def _model(family: str = "llama", seed: int = 0, **sizes) -> torch.nn.Module:
    return tiny_decoder(
        family, **{"layers": 3, "heads": 4, "head_dim": 3, "init_range": 0.3, "seed": seed, **sizes}
    )


def _logits(models, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([m.eval()(**inputs).logits for m in models])


@pytest.mark.parametrize(
    ("kept", "kv_heads", "kv_index"),
    [([0, 1], 1, [0, 0]), ([1, 2], 2, [0, 1]), ([3], 1, [0]), ([0, 2, 3], 2, [0, 1, 1])],
)
def test_a_key_value_head_goes_only_with_its_whole_group(kept, kv_heads, kv_index):
    model = _model()  # 4 query heads, 2 key/value heads: groups {0, 1} and {2, 3}
    pruned = he.prune(model, he.HeadSet({1: kept}))
    attention = pruned.model.layers[1].self_attn
    assert isinstance(attention, IndexedKVAttention)
    assert attention.kv_index.tolist() == [kv_index]
    assert attention.q_proj.out_features == 4 * len(kept) and attention.k_proj.out_features == 4 * kv_heads
    original = model.model.layers[1].self_attn
    kept_kv = sorted({h // 2 for h in kept})
    rows = torch.cat([torch.arange(4 * h, 4 * h + 4) for h in kept_kv])
    assert torch.equal(attention.k_proj.weight, original.k_proj.weight[rows])
    assert torch.equal(attention.v_proj.weight, original.v_proj.weight[rows])


def test_pruning_a_pruned_member_again_equals_pruning_once():
    model = _model("qwen3")
    once = he.prune(model, he.HeadSet({0: [2], 2: [0, 3]}))
    twice = he.prune(
        he.prune(model, he.HeadSet({0: [1, 2, 3], 2: [0, 1, 3]})), he.HeadSet({0: [2], 2: [0, 3]})
    )
    x = decoder_inputs(batch=3)
    assert torch.equal(_logits([once], x), _logits([twice], x))
    assert he.get_adapter(twice).attention_block(twice, 2).kv_index == (0, 1)


def test_explicit_grouped_query_attention_of_a_pruned_layer():
    """A pruned layer's output against attention written out: query head h of the kept ones
    against key/value head h // 2 of the original model, rotary embeddings, causal mask."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _model(layers=1)
    kept = [1, 2, 3]
    pruned = he.prune(model, he.HeadSet({0: kept}))
    x = decoder_inputs(batch=2, padded=False)
    hidden = model.model.embed_tokens(x["input_ids"])
    normed = model.model.layers[0].input_layernorm(hidden)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(9)[None])
    attention = model.model.layers[0].self_attn
    q = attention.q_proj(normed).unflatten(-1, (4, 4)).transpose(1, 2)
    k = attention.k_proj(normed).unflatten(-1, (2, 4)).transpose(1, 2)
    v = attention.v_proj(normed).unflatten(-1, (2, 4)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    causal = torch.ones(9, 9).tril().bool()
    heads = []
    for h in kept:
        scores = (q[:, h] @ k[:, h // 2].transpose(-1, -2)) / 2.0
        heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, h // 2])
    context = torch.stack(heads, 1).transpose(1, 2).flatten(-2)
    columns = torch.cat([torch.arange(4 * h, 4 * h + 4) for h in kept])
    expected = context @ attention.o_proj.weight[:, columns].T
    with torch.no_grad():
        out = pruned.model.layers[0].self_attn(
            hidden_states=normed, position_embeddings=(cos, sin), attention_mask=None
        )[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gemma3"])
def test_fusion_is_exact_with_left_padding_and_pools_the_last_real_token(family):
    model = _model(family)
    head_sets = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({1: [3], 2: [0, 1]})]
    left, right = decoder_inputs(batch=4, left=True), decoder_inputs(batch=4)
    assert (left["input_ids"][:, 0] == PAD).any() and (right["input_ids"][:, -1] == PAD).any()
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():
        fused = he.fuse(model, head_sets).eval()(**left).member_logits
    assert (fused - _logits(members, left)).abs().max().item() <= TOL
    # the pooled token is the last real one: padding after it changes nothing
    row = {k: v[2:3, : int(right["attention_mask"][2].sum())] for k, v in right.items()}
    assert torch.allclose(_logits(members, row)[:, 0], _logits(members, right)[:, 2], atol=1e-5)


def test_sliding_windows_are_kept_in_pruned_and_fused_models():
    """Mistral's window (4) is shorter than the inputs (9): every model here sees it."""
    windowed, full = _model("mistral"), _model("mistral")
    full.config.sliding_window = None
    x = decoder_inputs(batch=3, padded=False)
    assert (_logits([windowed], x) - _logits([full], x)).abs().max() > 1e-3
    heads = [he.HeadSet({0: [0, 1, 3], 2: [2]}), he.HeadSet({1: [1, 2]})]
    for model in (windowed, full):
        with torch.no_grad():
            out = he.fuse(model, heads).eval()(**x).member_logits
        assert (out - _logits([he.prune(model, hs) for hs in heads], x)).abs().max().item() <= TOL


def test_fine_tuned_q_and_k_norms_stay_per_member():
    model = _model("qwen3")
    head_sets = [he.HeadSet({0: [0, 1], 2: [3]}), he.HeadSet({0: [2, 3], 1: [0]})]
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():
        members[1].model.layers[0].self_attn.q_norm.weight.mul_(1.7)
        members[0].model.layers[2].self_attn.k_norm.weight.add_(0.3)
    x = decoder_inputs(batch=3)
    with torch.no_grad():
        out = he.fuse(members, mlp="exact").eval()(**x).member_logits
    assert (out - _logits(members, x)).abs().max().item() <= TOL
    merged = he.fuse(members, mlp="merge")  # attention, its norms included, is per member still
    for layer, name in ((0, "q_norm"), (2, "k_norm")):
        norms = getattr(merged.model.model.layers[layer].self_attn, name).members
        for norm, member in zip(norms, members, strict=True):
            assert torch.equal(norm.weight, getattr(member.model.layers[layer].self_attn, name).weight)


def test_taylor_scores_of_query_heads_against_the_formula():
    """Per query head: (mean |W g| over its W_Q rows + over its key/value head's W_K rows + W_V
    rows) / 3, the key/value terms shared by the heads of one group."""
    model = _model(layers=2)
    batch = labelled(decoder_inputs(batch=6, seed=3), seed=3)
    scores = he.taylor_scores(model, [batch], precision="fp32")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = torch.nn.functional.cross_entropy(model(**inputs).logits, batch["labels"])
    attention = model.model.layers[1].self_attn
    weights = [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
    grads = torch.autograd.grad(loss, weights)
    terms = [(w * g).abs().detach().view(-1, 4 * 12).mean(1) for w, g in zip(weights, grads, strict=True)]
    expected = torch.stack([(terms[0][h] + terms[1][h // 2] + terms[2][h // 2]) / 3 for h in range(4)])
    torch.testing.assert_close(scores[1], expected, rtol=1e-5, atol=1e-9)


def test_effective_parameters_count_only_the_kept_heads():
    model = _model("qwen3")
    head_sets = [he.HeadSet({0: [0], 1: [0, 1, 2, 3]}), he.HeadSet({0: [1, 2, 3], 2: []})]
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():  # fine-tuned: no weight shared, every module per member
        for i, member in enumerate(members):
            for p in member.parameters():
                p.add_(0.01 * (i + 1))
    hydra = he.fuse(members, mlp="exact")
    assert hydra.num_parameters() == sum(p.numel() for m in members for p in m.parameters())
    assert hydra.num_parameters(effective=False) > hydra.num_parameters()


def test_a_shared_trunk_takes_per_row_positions():
    """Positions given per input row reach the trunk (one copy) and the members' layers alike."""
    model = _model()
    head_sets = [he.HeadSet({0: [0, 1, 3], 1: [m], 2: [m, 3]}) for m in range(3)]
    hydra = he.fuse(model, head_sets).eval()
    assert hydra.trunk_layers == 1
    x = decoder_inputs(batch=3, padded=False)
    x["position_ids"] = torch.arange(9).repeat(3, 1) + torch.tensor([[0], [2], [5]])
    with torch.no_grad():
        out = hydra(**x).member_logits
    assert (out - _logits([he.prune(model, hs) for hs in head_sets], x)).abs().max().item() <= TOL


def test_padding_the_pooling_would_misread_is_refused_everywhere():
    """Padding with another id than ``config.pad_token_id`` makes the pooling read a padded
    position as the input's end (a silently wrong prediction): every entry point refuses it."""
    from hydra_ensembles.analysis import proposition1
    from hydra_ensembles.baselines import unstructured_prune
    from hydra_ensembles.evaluation import predict
    from hydra_ensembles.training import FineTuneConfig, fine_tune

    model = _model(layers=2)
    good = labelled(decoder_inputs())
    bad = {**good, "input_ids": good["input_ids"].masked_fill(good["attention_mask"] == 0, PAD + 5)}
    assert not torch.allclose(_logits([model], bad), _logits([model], good))  # what is guarded
    members = [he.prune(model, he.HeadSet({0: [0, m + 1], 1: [m]})) for m in range(2)]
    misread = re.escape(
        "padded with token id 5 but the model's last-token pooling looks for config.pad_token_id 0"
    )
    calls = {
        "predict": lambda b: predict(model, b, progress=False),
        "predict an ensemble": lambda b: predict(members, b, progress=False),
        "predict a Hydra model": lambda b: predict(he.fuse(members), b, progress=False),
        "taylor": lambda b: he.taylor_scores(model, b, progress=False),
        "circuit": lambda b: he.extract_circuit(model, b, b, budget=1, progress=False),
        "fine-tune": lambda b: fine_tune(model, b, b, FineTuneConfig(epochs=1), progress=False),
        "oba": lambda b: unstructured_prune(model, b, 0.1, "oba"),
        "proposition 1": lambda b: proposition1(model, b, b, he.HeadSet({0: [0, 1], 1: [0, 1, 2]}), probes=2),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match=misread):  # CircuitError (a ValueError) for the circuit
            call([bad])
        call([good])  # padded as the pooling reads it: runs
    model.config.pad_token_id = None
    with pytest.raises(ValueError, match=r"is padded but the model names no config\.pad_token_id"):
        predict(model, [good], progress=False)
    predict(model, [decoder_inputs(batch=1, padded=False)], progress=False)  # nothing padded to misread
