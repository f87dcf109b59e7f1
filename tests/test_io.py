"""Writes that fail after they started leave the old result (or nothing) and no temporary files."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.saving import formats as serialization
from hydra_ensembles.saving.files import atomic_dir, atomic_write, atomic_write_text
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
        "config.json",
        "member_config.json",
        "model.safetensors",
    ]


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_atomic_dir_never_deletes_the_old_result_when_it_cannot_be_moved(tmp_path, monkeypatch):
    """Replacing a mount point fails ("Device or resource busy"): the old folder stays whole and
    the new result is kept where the error says, never both lost."""
    import errno
    import os

    from hydra_ensembles.saving import files as io
    from hydra_ensembles.saving.files import OutputError

    target = tmp_path / "model"
    atomic_dir(target, lambda tmp: (tmp / "a.txt").write_text("old"))
    real = os.replace

    def busy(src, dst, *args, **kwargs):
        if os.fspath(src) == os.fspath(target):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), os.fspath(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(io.os, "replace", busy)
    with pytest.raises(OutputError, match="new result is in") as caught:
        atomic_dir(target, lambda tmp: (tmp / "a.txt").write_text("new"))
    assert (target / "a.txt").read_text() == "old"
    kept = [p for p in tmp_path.iterdir() if p.name != "model"]
    assert len(kept) == 1 and (kept[0] / "a.txt").read_text() == "new" and str(kept[0]) in str(caught.value)


def test_a_mount_point_is_refused_up_front_where_the_folder_is_replaced(tmp_path, monkeypatch):
    from hydra_cli.guards import check_output_dir
    from hydra_ensembles.saving import files as io
    from hydra_ensembles.saving.files import OutputError

    monkeypatch.setattr(io.os.path, "ismount", lambda p: str(p) == str(tmp_path))
    with pytest.raises(OutputError, match="mount point"):
        check_output_dir(tmp_path, overwrite=True, replaced=True)
    check_output_dir(tmp_path / "inside", overwrite=True, replaced=True)


def test_what_a_killed_writer_left_never_blocks_the_rerun(tmp_path):
    """A killed save leaves its temporary files (safetensors written under our own temporary
    names); the next check of the folder removes them instead of calling it "not empty"."""
    from hydra_cli.guards import check_output_dir
    from hydra_ensembles.saving.files import OutputError

    out = tmp_path / "fused"
    out.mkdir()
    stale = out / f".model.safetensors.{_dead_pid()}.x1y2.tmp"
    stale.write_bytes(b"\0" * 1000)
    parent = out / f".model.safetensors.{__import__('os').getppid()}.abcd.tmp"  # a live writer's
    parent.write_bytes(b"\0")
    with pytest.raises(OutputError, match="not empty"):
        check_output_dir(out, finished="hydra_config.json", overwrite=False)
    assert not stale.exists() and parent.exists()
    parent.unlink()
    check_output_dir(out, finished="hydra_config.json", overwrite=False)


def test_a_second_writer_of_one_output_is_refused_while_the_first_holds_it(tmp_path):
    from hydra_cli.guards import output_lock
    from hydra_ensembles.saving.files import OutputError

    out = tmp_path / "new" / "deeper" / "result.json"
    with output_lock(out):
        assert (tmp_path / "new" / "deeper" / ".result.json.lock").is_file()
        with pytest.raises(OutputError, match="another process is writing"), output_lock(out):
            pass
        with output_lock(tmp_path / "other.json"):  # another output: no conflict
            pass
    assert not (tmp_path / "new").exists()  # the folders made for the lock are gone again
    with output_lock(out):  # released: the next writer gets it
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("{}")
    assert sorted(p.name for p in out.parent.iterdir()) == ["result.json"]


def test_a_file_set_is_written_and_read_as_one(tmp_path):
    from hydra_ensembles.saving.files import load_file_set, save_file_set

    assert load_file_set(tmp_path) is None
    both = {"a.txt": lambda t: t.write_text("1"), "b.txt": lambda t: t.write_text("2")}
    save_file_set(tmp_path, both, {"n": 1})
    save_file_set(tmp_path, {"a.txt": lambda t: t.write_text("3")}, {"n": 2})
    meta, files = load_file_set(tmp_path)
    assert meta == {"n": 2} and files["a.txt"].read_text() == "3" and set(files) == {"a.txt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.2.txt", "manifest.json"]
    files["a.txt"].write_text("4")
    with pytest.raises(ValueError, match="differs from what was saved"):
        load_file_set(tmp_path)


def test_csv_cells_a_spreadsheet_would_run_are_neutralised(tmp_path):
    from hydra_ensembles.saving.files import atomic_write_records

    texts = ['=HYPERLINK("http://x")', "+1+2", "-2+3", "@SUM(A1)", "\tcmd", "plain", "a = b"]
    rows = [{"id": str(i), "text": t, "ood_score_energy": -1.5, "n": 3} for i, t in enumerate(texts)]
    atomic_write_records(tmp_path / "p.csv", rows)
    read = list(csv.DictReader((tmp_path / "p.csv").open(newline="")))
    assert [r["text"] for r in read] == ["'" + t for t in texts[:5]] + texts[5:]
    assert {r["ood_score_energy"] for r in read} == {"-1.5"}  # numbers are not text cells
    atomic_write_records(tmp_path / "p.jsonl", rows)  # JSON Lines keep every value as it is
    assert [json.loads(line)["text"] for line in (tmp_path / "p.jsonl").read_text().splitlines()] == texts


def _disk_full(target):
    import errno
    import os

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))


def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing_behind(tmp_path):
    """A file, a folder and a checkpoint set whose write runs out of space: OutputError naming the
    output (not a temporary), the old content kept, no temporary or half set left."""
    from hydra_ensembles.saving.files import OutputError, load_file_set, save_file_set

    old = atomic_write_text(tmp_path / "out.txt", "old")
    with pytest.raises(OutputError, match=r"cannot write .*out\.txt: no space left on the device"):
        atomic_write(old, _disk_full)
    assert old.read_text() == "old"
    with pytest.raises(OutputError, match=r"cannot write .*folder: no space left"):
        atomic_dir(tmp_path / "folder", _disk_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
    checkpoint = tmp_path / "ckpt"
    save_file_set(checkpoint, {"a.txt": lambda t: t.write_text("1")}, {"n": 1})
    with pytest.raises(OutputError, match="no space left"):  # the second file of the set fails
        save_file_set(checkpoint, {"a.txt": lambda t: t.write_text("2"), "b.txt": _disk_full}, {"n": 2})
    meta, files = load_file_set(checkpoint)
    assert meta == {"n": 1} and files["a.txt"].read_text() == "1"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["a.1.txt", "manifest.json"]


def test_a_full_disk_during_finetune_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """The CLI's finetune out of space while saving its model: exit 2, one line, no output and no
    temporary beside it (only the checkpoint a rerun resumes from)."""
    import transformers.modeling_utils
    from transformers import BertConfig, BertForSequenceClassification

    from hydra_cli import main

    config = BertConfig(hidden_size=24, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "model")
    he.models.load_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "train.csv").write_text("text,label\n" + "\n".join(f"w{i} x,{'ab'[i % 2]}" for i in range(8)))
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", lambda *a, **k: _disk_full("x"))
    argv = ["finetune", str(tmp_path / "model"), "--data", str(tmp_path / "train.csv"), "--epochs", "1"]
    assert main([*argv, "--batch-size", "4", "--max-length", "8", "--out", str(tmp_path / "tuned")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hydra-ens: error: cannot write") and "no space left on the device" in err[-1]
    left = sorted(p.name for p in tmp_path.iterdir())  # the epochs' checkpoint stays: a rerun resumes
    assert left == ["model", "train.csv", "tuned.checkpoint"]


def test_the_library_refuses_a_folder_of_the_users_files_without_naming_cli_options(tmp_path):
    """`export_onnx` replaces its folder whole: a folder of the user's own files is refused, in
    words for a Python caller (the command line's guard adds its options to the same check)."""
    from hydra_cli.guards import check_output_dir
    from hydra_ensembles.saving.files import OutputError, check_replaceable_dir

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    with pytest.raises(OutputError, match="did not write, which replacing it would delete") as library:
        check_replaceable_dir(folder)
    assert "--" not in str(library.value)
    with pytest.raises(OutputError, match=r"choose another --out \(--overwrite"):
        check_output_dir(folder, replaced=True)
    assert (folder / "notes.txt").read_text() == "the user's"
