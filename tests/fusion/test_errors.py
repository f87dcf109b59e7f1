"""Bad input gives a clear exception and writes nothing."""

import pytest
import torch
from transformers import GPT2Config, GPT2Model

import hydra_ensembles as he
from tests.factories import text_inputs, tiny_bert


def test_head_index_out_of_range(tmp_path):
    with pytest.raises(he.HeadSetError, match="head index 4 out of range in layer 1"):
        he.fuse(tiny_bert(layers=2, heads=4), [he.HeadSet(), he.HeadSet({1: [0, 4]})])


def test_duplicate_heads():
    with pytest.raises(he.HeadSetError, match="duplicate heads"):
        he.fuse(tiny_bert(), [he.HeadSet({0: [1, 1]})])


def test_members_from_different_bases():
    a = he.prune(tiny_bert(seed=1), he.HeadSet({0: [0]}))
    b = he.prune(tiny_bert(seed=2), he.HeadSet({0: [1]}))
    with pytest.raises(he.FusionError, match="different base models"):
        he.fuse([a, b])
    c = he.prune(tiny_bert(layers=3, seed=1), he.HeadSet({0: [0]}))
    with pytest.raises(he.FusionError, match="different configuration"):
        he.fuse([a, c])


def test_zero_members():
    with pytest.raises(he.FusionError, match="M = 0"):
        he.fuse([])
    with pytest.raises(he.FusionError, match="M = 0"):
        he.fuse(tiny_bert(), [])


def test_wrong_input_keys():
    hydra = he.fuse(tiny_bert(), [he.HeadSet({0: [0]})])
    with pytest.raises(TypeError, match=r"unexpected input\(s\) \['pixel_values'\].*accepted:.*input_ids"):
        hydra(pixel_values=torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="no tensor inputs"):
        hydra()


def test_unsupported_architecture():
    gpt2 = GPT2Model(GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=10))
    with pytest.raises(he.UnsupportedModelError, match="supported families"):
        he.fuse(gpt2, [he.HeadSet()])


def test_bad_modes_and_arguments():
    model = tiny_bert()
    with pytest.raises(ValueError, match="mlp must be one of"):
        he.fuse(model, [he.HeadSet()], mlp="average")
    with pytest.raises(TypeError, match="one HeadSet per member"):
        he.fuse(model)
    with pytest.raises(TypeError, match="HeadSet values"):
        he.fuse(model, [{0: [1]}])
    with pytest.raises(TypeError, match="members carry their own heads"):
        he.fuse([model], [he.HeadSet()])
    with pytest.raises(he.FusionError, match="unpruned base"):
        he.fuse(he.prune(model, he.HeadSet({0: [0]})), [he.HeadSet()])


def test_bad_heads_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "hydra"
    with pytest.raises(he.HeadSetError):
        he.fuse(tiny_bert(), [he.HeadSet({0: [9]})]).save_pretrained(out)
    assert not out.exists()


def test_labels_without_logits_are_refused():
    from transformers import BertConfig, BertModel

    model = BertModel(
        BertConfig(
            vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=9
        )
    )
    hydra = he.fuse(model, [he.HeadSet()])
    with pytest.raises(ValueError, match="no logits"):
        hydra(**text_inputs(batch=2), labels=torch.tensor([0, 1]))
