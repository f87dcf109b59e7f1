"""The library's record on a model (`saving.metadata`): one typed record, stored as the ``hydra_*``
configuration fields every saved format has always written."""

from __future__ import annotations

import json

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.baselines import batch_ensemble
from hydra_ensembles.baselines.batch_ensemble import BATCH_ENSEMBLE_KEY
from hydra_ensembles.saving.metadata import (
    CONFIG_KEYS,
    ModelMetadata,
    read_metadata,
    register_transform_key,
    split_metadata,
    write_metadata,
)
from hydra_ensembles.training import training_summary
from tests.factories import text_inputs, tiny_bert


def test_a_model_without_a_record_reads_as_empty():
    assert read_metadata(tiny_bert()) == ModelMetadata()


def test_written_fields_read_back_and_none_removes_them():
    model = tiny_bert()
    heads = he.HeadSet({0: [1, 2], 1: [0]})
    write_metadata(model, kept_heads=heads, max_length=64, training={"optimizer_steps": 3, "stages": [3]})
    record = read_metadata(model)
    assert record.kept_heads == heads and record.max_length == 64
    assert record.training == {"optimizer_steps": 3, "stages": [3]}
    assert model.config.to_dict()[CONFIG_KEYS["kept_heads"]] == heads.to_dict()  # what config.json holds
    write_metadata(model, max_length=None)
    assert read_metadata(model).max_length is None
    assert CONFIG_KEYS["max_length"] not in model.config.to_dict()


def test_unknown_fields_and_unregistered_transforms_are_refused():
    model = tiny_bert()
    with pytest.raises(TypeError, match="no metadata field"):
        write_metadata(model, temperature=2.0)
    with pytest.raises(TypeError, match="no registered member transform"):
        write_metadata(model, member_transforms={"hydra_not_a_transform": 2})
    with pytest.raises(ValueError, match="already a metadata field"):
        register_transform_key(CONFIG_KEYS["calibration"])


def test_pruning_and_a_baseline_record_themselves_and_split_from_the_config():
    base = tiny_bert()
    member = he.prune(base, he.HeadSet({0: [0, 1], 1: [2]}))
    converted = batch_ensemble(member, num_members=2)
    record, rest = split_metadata(converted.config.to_dict())
    assert record.kept_heads == he.HeadSet({0: [0, 1], 1: [2]})
    assert record.base_fingerprint == read_metadata(member).base_fingerprint
    assert record.member_transforms == {BATCH_ENSEMBLE_KEY: 2}
    assert not any(k.startswith("hydra_") for k in rest)
    assert read_metadata(rest) == ModelMetadata()


def test_a_saved_member_keeps_its_record_in_its_config(tmp_path):
    member = he.prune(tiny_bert(), he.HeadSet({0: [3], 1: [0, 1]}))
    write_metadata(member, max_length=32, training={"optimizer_steps": 5, "stages": [5]})
    he.save_member(member, tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "member_config.json").read_text())["config"]
    assert saved["hydra_kept_heads"] == {"0": [3], "1": [0, 1]} and saved["hydra_max_length"] == 32
    assert read_metadata(he.load_member(tmp_path / "m")) == read_metadata(member)


def test_members_trained_for_different_step_counts_fuse_and_the_model_records_each():
    base = tiny_bert()
    members = [he.prune(base, he.HeadSet({0: [0, 1], 1: [2]})), he.prune(base, he.HeadSet({0: [3], 1: [0]}))]
    for member, steps in zip(members, (6, 9), strict=True):  # early stopping kept another epoch
        write_metadata(member, training={"optimizer_steps": steps, "stages": [steps], "epochs": steps // 3})
    hydra = he.fuse(members)
    assert read_metadata(hydra.model).training == {"members": [read_metadata(m).training for m in members]}
    assert training_summary(hydra) == "6-9 optimizer steps per member"
    inputs = text_inputs(batch=2, tokens=5)
    with torch.no_grad():
        explicit = torch.stack([m(**inputs).logits for m in members])
        assert torch.allclose(hydra(**inputs).member_logits, explicit, atol=1e-5)
    same = [he.prune(base, he.HeadSet({0: [0], 1: [1]})), he.prune(base, he.HeadSet({0: [2], 1: [3]}))]
    for member in same:
        write_metadata(member, training={"optimizer_steps": 4, "stages": [4]})
    assert read_metadata(he.fuse(same).model).training == {"optimizer_steps": 4, "stages": [4]}
