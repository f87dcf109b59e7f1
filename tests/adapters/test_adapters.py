import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, ViTConfig, ViTModel

from hydra_ensembles import UnsupportedModelError, get_adapter
from hydra_ensembles.adapters import BertAdapter, ViTAdapter
from hydra_ensembles.adapters.bert import FirstQueryAttention
from tests.factories import text_inputs, tiny_bert, tiny_vit


@pytest.mark.parametrize(
    ("factory", "adapter", "q_name"),
    [(tiny_bert, BertAdapter, "query"), (tiny_vit, ViTAdapter, "q_proj")],
)
def test_task_models_expose_their_attention(factory, adapter, q_name):
    model = factory(layers=3, heads=4, head_dim=5)
    found = get_adapter(model)
    assert isinstance(found, adapter)
    assert found.num_layers(model) == 3
    assert found.original_heads_per_layer(model) == [4, 4, 4]
    block = found.attention_block(model, 2)
    assert (block.num_heads, block.head_dim, block.hidden_size) == (4, 5, 20)
    assert block.query is dict(model.named_modules())[found.layers_path + f".2.{_attn(adapter)}{q_name}"]


def _attn(adapter) -> str:
    return "attention.self." if adapter is BertAdapter else "attention."


def test_bare_base_models_are_supported():
    bert = BertModel(
        BertConfig(
            vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=9
        )
    )
    vit = ViTModel(
        ViTConfig(
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=9,
            image_size=8,
            patch_size=4,
            num_channels=1,
        )
    )
    assert get_adapter(bert).prefix == "" and get_adapter(vit).prefix == ""
    assert get_adapter(bert).attention_block(bert, 0).num_heads == 2
    assert get_adapter(vit).attention_block(vit, 0).num_heads == 2


def test_parts_for_fusion_policy():
    model = tiny_bert()
    adapter = get_adapter(model)
    modules = dict(model.named_modules())
    assert (
        adapter.part_of(
            "bert.encoder.layer.0.intermediate.dense", modules["bert.encoder.layer.0.intermediate.dense"]
        )
        == "mlp"
    )
    assert (
        adapter.part_of(
            "bert.encoder.layer.0.output.LayerNorm", modules["bert.encoder.layer.0.output.LayerNorm"]
        )
        == "norm"
    )
    assert adapter.part_of("classifier", modules["classifier"]) == "classifier"
    assert adapter.part_of("bert.pooler.dense", modules["bert.pooler.dense"]) == "classifier"
    assert adapter.part_of("bert.embeddings.LayerNorm", modules["bert.embeddings.LayerNorm"]) == "embeddings"


def test_unsupported_architecture_names_the_supported_families():
    gpt2 = GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=10))
    with pytest.raises(UnsupportedModelError, match=r"GPT2Model.*supported families: .*BERT.*ViT"):
        get_adapter(gpt2)
    with pytest.raises(UnsupportedModelError):
        get_adapter(torch.nn.Linear(2, 2))


def test_a_module_layout_of_another_transformers_release_is_refused_naming_it():
    """DINOv2 before transformers 5.18 kept ``attention.attention.query``: a layer without the
    projections the adapter names is one line naming the release, not an AttributeError later."""
    import transformers

    model = tiny_vit(layers=2, heads=4, head_dim=3)
    get_adapter(model)
    for layer in get_adapter(model).layers(model):
        layer.attention.query = layer.attention.q_proj
        del layer.attention.q_proj
    message = rf"no 'attention.q_proj'.*transformers {transformers.__version__}.*>= 5\.18"
    with pytest.raises(UnsupportedModelError, match=message):
        get_adapter(model)


def test_first_token_only_keeps_the_logits_and_shrinks_the_last_layer():
    model = tiny_bert(layers=3, heads=4, head_dim=3, init_range=0.3).eval()
    inputs = text_inputs(batch=5, tokens=9, seed=2)
    adapter = get_adapter(model)
    shapes = []
    probe = adapter.layers(model)[-1].register_forward_hook(lambda _m, _a, out: shapes.append(out[0].shape))
    with torch.no_grad():
        full = model(**inputs).logits
        handle = adapter.first_token_only(model)
        core = model.bert.encoder.layer[-1].attention.self
        assert isinstance(core, FirstQueryAttention)  # the last layer's query for [CLS] only
        short = model(**inputs).logits
        handle.close()
        again = model(**inputs).logits
    probe.remove()
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-6)
    assert not isinstance(model.bert.encoder.layer[-1].attention.self, FirstQueryAttention)
    assert torch.equal(again, full) and shapes[1][-2] == 1 and shapes[0][-2] == 9 == shapes[2][-2]
    assert get_adapter(tiny_vit()).first_token_only(tiny_vit()) is None  # ViT adds the residual itself
