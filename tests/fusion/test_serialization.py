"""save_pretrained / load_hydra: bitwise-identical round trips and clear errors on damaged files."""

import json

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.fusion.model import CONFIG_NAME, WEIGHTS_NAME
from hydra_ensembles.hashing import config_digest
from tests.factories import image_inputs, text_inputs, tiny_bert, tiny_vit

HEADS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({1: [3]})]


def _members(model):
    members = []
    for i, hs in enumerate(HEADS):
        member = he.prune(model, hs)
        with torch.no_grad():
            for p in member.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        members.append(member)
    return members


@pytest.mark.parametrize(
    ("build", "inputs"),
    [
        (lambda: he.fuse(tiny_bert(), HEADS), text_inputs),
        (lambda: he.fuse(_members(tiny_bert()), mlp="exact"), text_inputs),
        (lambda: he.fuse(_members(tiny_bert()), mlp="merge"), text_inputs),
        (lambda: he.fuse(_members(tiny_vit()), mlp="exact"), image_inputs),
        (lambda: he.fuse(tiny_vit(), HEADS).to(torch.bfloat16), image_inputs),
    ],
)
def test_round_trip_is_bitwise_identical(tmp_path, build, inputs):
    hydra = build().eval()
    hydra.save_pretrained(tmp_path)
    loaded = he.load_hydra(tmp_path)
    x = inputs()
    with torch.no_grad():
        before, after = hydra(**x), loaded(**x)
    assert torch.equal(before.member_logits, after.member_logits)
    assert loaded.head_sets == hydra.head_sets and loaded.policy == hydra.policy
    assert loaded.layout == hydra.layout
    assert next(loaded.parameters()).dtype == next(hydra.parameters()).dtype
    # no temp files left; config.json routes transformers' Auto classes to the library's loader
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", CONFIG_NAME, WEIGHTS_NAME]


def test_from_pretrained_is_load_hydra(tmp_path):
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    assert isinstance(he.HydraModel.from_pretrained(tmp_path), he.HydraModel)


def test_truncated_weights_are_refused(tmp_path):
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    weights = tmp_path / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(he.HydraLoadError, match="truncated, corrupted or was modified"):
        he.load_hydra(tmp_path)


def test_tampered_weights_are_refused(tmp_path):
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    weights = tmp_path / WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(he.HydraLoadError, match="checksum"):
        he.load_hydra(tmp_path)


def test_tampered_config_is_refused(tmp_path):
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    config_file = tmp_path / CONFIG_NAME
    config = json.loads(config_file.read_text())
    for head_set in config["head_sets"]:
        head_set["0"] = [0]  # claims other head counts than the weights hold
    config_file.write_text(json.dumps(config))
    with pytest.raises(he.HydraLoadError, match="modified after saving"):
        he.load_hydra(tmp_path)
    config["config_sha256"] = config_digest(config)  # a consistent forgery still cannot load
    config_file.write_text(json.dumps(config))
    with pytest.raises(he.HydraLoadError, match="do not fit"):
        he.load_hydra(tmp_path)
    config["model_class"] = "os.system"
    config["config_sha256"] = config_digest(config)
    config_file.write_text(json.dumps(config))
    with pytest.raises(he.HydraLoadError, match="unsupported model class"):
        he.load_hydra(tmp_path)
    config_file.write_text("{not json")
    with pytest.raises(he.HydraLoadError, match="not valid JSON"):
        he.load_hydra(tmp_path)


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(he.HydraLoadError, match="not a saved Hydra model"):
        he.load_hydra(tmp_path)
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(he.HydraLoadError, match="missing"):
        he.load_hydra(tmp_path)


def test_weights_file_is_safetensors_not_pickle(tmp_path):
    he.fuse(tiny_bert(), HEADS).save_pretrained(tmp_path)
    raw = (tmp_path / WEIGHTS_NAME).read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    assert any(k.endswith("qkv_weight") for k in header)
