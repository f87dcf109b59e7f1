"""The hydra-ens command line: help, info and fuse."""

import json

import pytest
import torch

import hydra_ensembles as he
from hydra_cli import main
from tests.factories import FAMILIES, text_inputs, tiny_bert


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


@pytest.mark.parametrize(
    ("family", "name"),
    [("bert", "BERT"), ("distilbert", "DistilBERT"), ("deit", "ViT"), ("clip", "CLIP (vision)")],
)
def test_info_on_a_local_directory_keeps_its_head(family, name, tmp_path, capsys):
    FAMILIES[family][0](labels=3).save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0  # the saved 3-way head loads as it is
    out = capsys.readouterr().out
    assert f"family {name}" in out and "[4, 4] of [4, 4]" in out


def test_fuse_from_head_set_files(local_model, tmp_path):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps([{"0": [0, 1]}, {"1": []}]))
    out_dir = tmp_path / "hydra"
    assert main(["fuse", str(local_model), "--heads", str(heads), "--out", str(out_dir)]) == 0
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


def test_info_on_a_saved_hydra_model_and_member(tmp_path, capsys):
    model = tiny_bert(layers=2, heads=4)
    heads = [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({0: [0, 1, 2], 1: [3]})]
    he.fuse(model, heads).save_pretrained(tmp_path / "hydra")
    assert main(["info", str(tmp_path / "hydra")]) == 0
    out = capsys.readouterr().out
    assert "fused Hydra of BertForSequenceClassification" in out and "members: 2; shared trunk: 1" in out
    assert "member 1: heads per layer [3, 1] of [4, 4]" in out
    he.members.save_member(he.prune(model, heads[1]), tmp_path / "member")
    assert main(["info", str(tmp_path / "member")]) == 0
    assert "heads per layer: [3, 1] of [4, 4]" in capsys.readouterr().out
    he.members.save_member(he.baselines.batch_ensemble(model, 3), tmp_path / "be")
    assert main(["info", str(tmp_path / "be")]) == 0
    assert "BatchEnsemble of 3 members" in capsys.readouterr().out


def test_every_command_is_one_record_whose_parser_runs_it():
    """`COMMANDS` holds one record per subcommand; the parser of each routes to that record."""
    import argparse

    from hydra_cli import build_parser
    from hydra_cli.main import COMMANDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert [c.name for c in COMMANDS] == list(sub.choices)
    for command in COMMANDS:
        assert sub.choices[command.name].get_default("record") is command


def test_the_calibration_options_default_to_the_librarys_calibration():
    """One place for the calibration's defaults: each command's options, left out, ask for the
    `CalibrationConfig()` a library user gets, and BuildConfig and SweepConfig calibrate alike."""
    import argparse

    from hydra_cli import build_parser
    from hydra_cli.options import calibration_config
    from hydra_ensembles.build import BuildConfig
    from hydra_ensembles.calibration import CalibrationConfig
    from hydra_ensembles.sweep.grid import SweepConfig

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = ("build", "calibrate", "finetune", "sweep", "zero-shot")
    for name in commands:
        parser = sub.choices[name]
        parser.complete()
        defaults = argparse.Namespace(**{a.dest: a.default for a in parser._actions})
        assert calibration_config(defaults) == CalibrationConfig(), name
    assert BuildConfig().calibration == SweepConfig(num_pruned=(2,)).calibration == CalibrationConfig()
    assert CalibrationConfig().score == "auto" and CalibrationConfig().set_method == "lac"


def test_help_states_every_default():
    """Every option with a default says it in ``--help`` (a user must not have to read code)."""
    import argparse

    from hydra_cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        parser.complete()
        assert len(parser._actions) > 1, name  # more than --help
        formatter = parser._get_formatter()
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default is None or default is False:
                continue
            if default == argparse.SUPPRESS or isinstance(default, list):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, (name, action.option_strings, default)


def test_a_bug_in_the_library_is_an_internal_error_not_bad_input(local_model, monkeypatch, capsys):
    """A TypeError raised inside the library ends in exit 1 with one line saying it is internal
    (HYDRA_DEBUG=1 lets the traceback through); a refusal of the input stays exit 2."""
    from hydra_ensembles import loading

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(loading, "load_any", broken)
    assert main(["info", str(local_model)]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("hydra-ens: internal error: TypeError: unsupported operand") and "HYDRA_DEBUG=1" in err
    )
    assert len(err.splitlines()) == 1
    monkeypatch.setenv("HYDRA_DEBUG", "1")
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["info", str(local_model)])
    monkeypatch.delenv("HYDRA_DEBUG")
    monkeypatch.undo()
    assert main(["info", "/nonexistent/model"]) == 2


def test_a_plain_value_error_from_a_computation_is_internal_and_a_refusal_is_input(
    local_model, monkeypatch, capsys
):
    """Only the library's refusals (`InputError` and its subclasses) are bad input, exit 2; a
    plain ValueError raised inside a computation (numpy's, torch's) is a bug, exit 1."""
    from hydra_ensembles import InputError, loading

    def shapes(*args, **kwargs):
        raise ValueError("operands could not be broadcast together with shapes (3,) (4,)")

    monkeypatch.setattr(loading, "load_any", shapes)
    assert main(["info", str(local_model)]) == 1
    assert capsys.readouterr().err.startswith("hydra-ens: internal error: ValueError: operands")

    def refusal(*args, **kwargs):
        raise InputError("the model folder holds no weights")

    monkeypatch.setattr(loading, "load_any", refusal)
    assert main(["info", str(local_model)]) == 2
    assert capsys.readouterr().err.strip() == "hydra-ens: error: the model folder holds no weights"
