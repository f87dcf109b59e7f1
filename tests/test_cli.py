"""The hydra-ens command line: help, info, fuse, errors, and a reduced demo on the real data."""

import json

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.cli import main
from hydra_ensembles.demo import QuickDemoConfig, run_quick_demo
from tests.factories import text_inputs, tiny_bert


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("info", "fuse", "demo"):
        assert command in out


@pytest.fixture
def local_model(tmp_path):
    path = tmp_path / "tiny"
    tiny_bert(layers=2, heads=4).save_pretrained(path)
    return path


def test_info_on_a_local_directory(local_model, capsys):
    assert main(["info", str(local_model), "--num-labels", "3"]) == 0
    out = capsys.readouterr().out
    assert "family BERT" in out and "[4, 4] of [4, 4]" in out


def test_fuse_from_head_set_files(local_model, tmp_path):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps([{"0": [0, 1]}, {"1": []}]))
    out_dir = tmp_path / "hydra"
    assert (
        main(["fuse", str(local_model), "--heads", str(heads), "--num-labels", "3", "--out", str(out_dir)])
        == 0
    )
    hydra = he.load_hydra(out_dir)
    assert hydra.num_members == 2
    with torch.no_grad():
        assert hydra(**text_inputs()).member_logits.shape == (2, 4, 3)


def test_fuse_with_bad_heads_fails_cleanly_and_writes_nothing(local_model, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"0": [7]}))
    out_dir = tmp_path / "hydra"
    code = main(["fuse", str(local_model), "--heads", str(heads), "--num-labels", "3", "--out", str(out_dir)])
    assert code == 2
    assert "head index 7 out of range" in capsys.readouterr().err
    assert not out_dir.exists()


def test_reduced_demo_runs_end_to_end(tmp_path, capsys):
    result = run_quick_demo(QuickDemoConfig(train_limit=48, test_limit=24, out_dir=tmp_path))
    out = capsys.readouterr().out
    assert "Hydra (fused, one pass)" in out
    assert result["reload_identical"]
    assert result["argmax_agreement"] == 1.0
    assert result["max_abs_diff"] <= 1e-4
    fused, explicit = (
        result["results"]["Hydra (fused, one pass)"],
        result["results"]["members one by one, ensembled"],
    )
    assert fused["acc"] == pytest.approx(explicit["acc"]) and fused["nll"] == pytest.approx(
        explicit["nll"], abs=1e-4
    )
    assert (tmp_path / "hydra" / "hydra_config.json").is_file()
