import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model, ViTConfig, ViTModel

from hydra_ensembles import UnsupportedModelError, get_adapter
from hydra_ensembles.adapters import BertAdapter, ViTAdapter
from tests.factories import tiny_bert, tiny_vit


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
    assert adapter.part_of("classifier", modules["classifier"]) == "head"
    assert adapter.part_of("bert.pooler.dense", modules["bert.pooler.dense"]) == "head"
    assert adapter.part_of("bert.embeddings.LayerNorm", modules["bert.embeddings.LayerNorm"]) == "embeddings"


def test_unsupported_architecture_names_the_supported_families():
    gpt2 = GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=10))
    with pytest.raises(UnsupportedModelError, match=r"GPT2Model.*supported families: .*BERT.*ViT"):
        get_adapter(gpt2)
    with pytest.raises(UnsupportedModelError):
        get_adapter(torch.nn.Linear(2, 2))
