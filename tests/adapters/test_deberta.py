"""What makes DeBERTa different: disentangled attention, whose content-to-position and
position-to-content terms each kept head keeps (through W_K and W_Q in v3, through its own
position projections in v2), and a relative position table shared by all layers that fine-tuned
members may each change."""

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.layers import FusedDisentangledAttention, MemberTable
from tests.factories import text_inputs, tiny_deberta

TOL = 1e-4


def _model(v3: bool = True, seed: int = 0):
    return tiny_deberta(layers=3, heads=4, head_dim=3, init_range=0.3, seed=seed, v3=v3)


def _logits(models, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([m.eval()(**inputs).logits for m in models])


def test_a_pruned_v2_layer_keeps_its_heads_position_projections():
    model = _model(v3=False)
    pruned = he.prune(model, he.HeadSet({1: [3, 1]}))
    core, original = (
        pruned.deberta.encoder.layer[1].attention.self,
        model.deberta.encoder.layer[1].attention.self,
    )
    rows = torch.cat([torch.arange(3, 6), torch.arange(9, 12)])  # heads 1 and 3, in order
    for name in ("pos_key_proj", "pos_query_proj"):
        assert torch.equal(getattr(core, name).weight, getattr(original, name).weight[rows])
    again = he.prune(pruned, he.HeadSet({1: [3]}))  # pruned again: the rows of head 3 only
    assert torch.equal(
        again.deberta.encoder.layer[1].attention.self.pos_key_proj.weight, original.pos_key_proj.weight[9:12]
    )
    x = text_inputs(3)
    with torch.no_grad(), he.ablate(model, he.HeadSet({1: [3]})):
        assert (again(**x).logits - model(**x).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("v3", [True, False], ids=["v3", "v2"])
def test_position_terms_matter_and_each_member_keeps_its_own(v3):
    model = _model(v3)
    x = text_inputs(4, tokens=9)
    flat = _model(v3)
    with torch.no_grad():  # the same model without position terms answers differently
        for layer in flat.deberta.encoder.layer:
            layer.attention.self.pos_att_type = []
    assert (_logits([model], x) - _logits([flat], x)).abs().max() > 1e-2
    head_sets = [he.HeadSet({0: [0, 1], 2: [3]}), he.HeadSet({0: [2], 1: [0, 3]}), he.HeadSet({})]
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():  # fine-tuning changed each member's relative position table
        for i, member in enumerate(members):
            member.deberta.encoder.rel_embeddings.weight.mul_(1 + 0.2 * i)
    hydra = he.fuse(members, mlp="exact").eval()
    assert isinstance(hydra.model.deberta.encoder.rel_embeddings, MemberTable)
    assert all(
        isinstance(layer.attention.self, FusedDisentangledAttention)
        for layer in hydra.model.deberta.encoder.layer
    )
    with torch.no_grad():
        out = hydra(**x).member_logits
    assert (out - _logits(members, x)).abs().max().item() <= TOL
    merged = he.fuse(members, mlp="merge")  # the embeddings policy: one averaged table
    assert isinstance(merged.model.deberta.encoder.rel_embeddings, torch.nn.Embedding)


def test_a_model_with_a_convolution_layer_is_refused():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        conv_kernel_size=3, relative_attention=True, pooler_hidden_size=8,
    )  # fmt: skip
    with pytest.raises(TypeError, match="conv_kernel_size"):
        he.get_adapter(DebertaV2ForSequenceClassification(config))
