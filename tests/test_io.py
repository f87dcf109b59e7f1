"""Writes that fail after they started leave the old result (or nothing) and no temporary files."""

from __future__ import annotations

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles import serialization
from hydra_ensembles.io import atomic_dir, atomic_write, atomic_write_text
from tests.factories import text_inputs, tiny_bert


class Interrupted(RuntimeError):
    pass


def _half_then_fail(original):
    def write(state, path, *args, **kwargs):
        original(state, path, *args, **kwargs)
        with open(path, "r+b") as handle:
            handle.truncate(handle.seek(0, 2) // 2)
        raise Interrupted("disk full")

    return write


def test_atomic_write_failing_midway_keeps_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_text(target, "old")

    def write(tmp):
        tmp.write_text("new, half")
        raise Interrupted

    with pytest.raises(Interrupted):
        atomic_write(target, write)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    with pytest.raises(Interrupted):
        atomic_write(tmp_path / "fresh.json", write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_atomic_dir_failing_midway_keeps_the_old_directory_and_no_temp(tmp_path):
    target = tmp_path / "model"
    atomic_dir(target, lambda tmp: (tmp / "a.txt").write_text("old"))

    def write(tmp):
        (tmp / "a.txt").write_text("new")
        (tmp / "b.txt").write_text("half")
        raise Interrupted

    with pytest.raises(Interrupted):
        atomic_dir(target, write)
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"]
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_save_pretrained_failing_midway_leaves_nothing_that_loads(tmp_path, monkeypatch):
    hydra = he.fuse(tiny_bert(), [he.HeadSet({0: [0, 2]}), he.HeadSet({1: [1]})]).eval()
    monkeypatch.setattr(serialization, "save_file", _half_then_fail(serialization.save_file))
    with pytest.raises(Interrupted):
        hydra.save_pretrained(tmp_path / "hydra")
    assert list((tmp_path / "hydra").iterdir()) == []  # the half-written weights were removed
    with pytest.raises(he.HydraLoadError, match="not a saved Hydra model"):
        he.load_hydra(tmp_path / "hydra")
    monkeypatch.undo()
    hydra.save_pretrained(tmp_path / "hydra")
    x = text_inputs()
    with torch.no_grad():
        assert torch.equal(he.load_hydra(tmp_path / "hydra")(**x).member_logits, hydra(**x).member_logits)


def test_save_member_failing_midway_over_an_old_member_keeps_the_old_one(tmp_path, monkeypatch):
    old = he.prune(tiny_bert(), he.HeadSet({0: [0]}))
    he.save_member(old, tmp_path / "member")
    new = he.prune(tiny_bert(), he.HeadSet({0: [1, 2]}))
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    monkeypatch.setattr(serialization, "save_file", _half_then_fail(serialization.save_file))
    with pytest.raises(Interrupted):
        he.save_member(new, tmp_path / "member")
    loaded = he.load_member(tmp_path / "member")  # still the old member, complete and checked
    assert he.kept_heads(loaded) == he.kept_heads(old)
    assert sorted(p.name for p in (tmp_path / "member").iterdir()) == [
        "member_config.json",
        "model.safetensors",
    ]
