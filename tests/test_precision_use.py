"""The record of which tests compute in the precision (tests/precision_use.py), which decides
what the bf16 and fp16 reruns of scripts/test.sh run: a test that computes in the resolved
precision ``auto`` resolved from `HYDRA_PRECISION` (in its call, or in its fixtures' set-up) is
recorded; one that computes in a precision it pins, or in none, is not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.precision_use import SELECTED, USES, recorded, select_recorded

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os
import numpy as np
from tests.precision_use import record_from_environment
assert record_from_environment()
from hydra_ensembles.evaluation import Predictions, fit_temperature, predict
from tests.factories import labelled, text_inputs, tiny_bert

def test(name):
    os.environ["PYTEST_CURRENT_TEST"] = name

test("tests/a.py::test_numbers_only (call)")
fit_temperature(Predictions(np.random.default_rng(0).normal(size=(1, 8, 2)), np.arange(8) % 2))
test("tests/a.py::test_predicts[bert] (call)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False)
test("tests/b.py::test_uses_a_built_model (setup)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False)
test("tests/b.py::test_uses_a_pinned_model (setup)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False, precision="fp32")
test("tests/c.py::test_pins_fp32 (call)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False, precision="fp32")
test("tests/c.py::test_resolves_then_passes_the_name (call)")
from hydra_ensembles.precision import resolve_precision
name = resolve_precision("auto").name
predict(tiny_bert(), [labelled(text_inputs())], progress=False, precision=name)
test("tests/a.py::test_predicts[bert] (teardown)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False)
test("tests/d.py::test_grouped[a@b]@onnx (call)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False)
test("tests/d.py::test_at_in_its_parameter[c@d] (call)")
predict(tiny_bert(), [labelled(text_inputs())], progress=False)
"""


def test_tests_computing_in_the_precision_are_recorded_and_others_not(tmp_path):
    env = {**os.environ, USES: str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert recorded(tmp_path) == [
        "tests/a.py::test_predicts[bert]",
        "tests/b.py::test_uses_a_built_model",
        "tests/c.py::test_resolves_then_passes_the_name",
        "tests/d.py::test_grouped[a@b]",  # the id pytest selects by, without loadgroup's "@onnx"
        "tests/d.py::test_at_in_its_parameter[c@d]",
    ]


def test_nothing_is_recorded_without_the_folder(tmp_path, monkeypatch):
    from tests.precision_use import record_from_environment

    monkeypatch.delenv(USES, raising=False)
    assert not record_from_environment() and recorded(tmp_path) == []


def test_a_rerun_keeps_the_recorded_tests_in_pytests_order_and_refuses_one_not_collected(
    tmp_path, monkeypatch
):
    """The reruns run the recorded tests in the order pytest collects them (a module's tests
    together), whatever order they were recorded in, with or without loadgroup's suffix; a
    recorded test that was not collected stops the run instead of being skipped."""
    from types import SimpleNamespace

    import pytest

    ids = [
        "tests/a.py::test_one",
        "tests/a.py::test_two[x@y]@onnx",
        "tests/b.py::test_three",
        "tests/c.py::test",
    ]
    items = [SimpleNamespace(nodeid=test) for test in ids]
    listed = tmp_path / "recorded.txt"
    listed.write_text("tests/c.py::test\ntests/a.py::test_two[x@y]\ntests/a.py::test_one\n")
    monkeypatch.setenv(SELECTED, str(listed))
    gone = []
    select_recorded(items, gone.extend)
    assert [i.nodeid for i in items] == [ids[0], ids[1], ids[3]] and [i.nodeid for i in gone] == [ids[2]]
    listed.write_text("tests/a.py::test_one\ntests/d.py::test_renamed\n")
    with pytest.raises(LookupError, match=r"1 recorded test.* not collected .*tests/d\.py::test_renamed"):
        select_recorded([SimpleNamespace(nodeid=test) for test in ids], gone.extend)
    monkeypatch.delenv(SELECTED)
    everything = [SimpleNamespace(nodeid=test) for test in ids]
    select_recorded(everything, gone.extend)  # no file named: every test kept
    assert len(everything) == len(ids)


def _misplaced_marks(source: str) -> list[str]:
    """The functions of a test module that carry a pytest mark but are not tests (not named
    ``test*``): pytest collects no such function, so its mark selects nothing."""
    import ast

    misplaced = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("test"):
            marks = [d for d in node.decorator_list if "pytest.mark." in ast.unparse(d)]
            if marks:
                misplaced.append(node.name)
    return misplaced


def test_every_mark_sits_on_a_test():
    """A mark (``slow``, ``same_in_every_precision``, a parametrization) that slid onto a helper
    when code moved between it and its test selects nothing: the test runs where it should not,
    or unparametrized."""
    root = Path(__file__).resolve().parent
    found = {str(p.relative_to(root)): _misplaced_marks(p.read_text()) for p in root.rglob("test_*.py")}
    assert {name: funcs for name, funcs in found.items() if funcs} == {}
    assert _misplaced_marks("import pytest\n@pytest.mark.slow\ndef _helper():\n    pass\n") == ["_helper"]
