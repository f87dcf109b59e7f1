"""What starting the command line and importing the library cost: neither imports torch (about a
second on a 2-core machine) until a command works, so ``hydra-ens --help``, a mistyped command and
an argument error answer at once (``export``, whose options are the quantizer's settings,
excepted); saved models still load with transformers' Auto classes in whichever order the
packages are imported. Each case runs in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy")


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints a JSON object as its last line."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _parse(argv: list[str]) -> str:
    return f"""
import contextlib, io, json, sys
from hydra_cli import build_parser
out, err = io.StringIO(), io.StringIO()
code = 0
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        build_parser().parse_args({argv!r})
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "out": out.getvalue(), "err": err.getvalue(),
                   "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_importing_the_library_imports_no_torch():
    seen = _fresh(
        "import json, sys\nimport hydra_ensembles, hydra_ensembles.errors, hydra_ensembles.saving.files\n"
        f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules]}}))"
    )
    assert seen["loaded"] == []


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["--help"], 0, "predict"),
        (["predcit"], 2, "invalid choice: 'predcit'"),
        (["predict", "model"], 2, "the following arguments are required: --data, --out"),
        (
            ["build", "tuned", "--members", "0", "--scores", "s.json", "--heads-per-layer", "2"],
            2,
            "--members",
        ),
        (["calibrate", "m", "--out", "o", "--engine", "spark"], 2, "invalid choice: 'spark'"),
        (["serve", "--help"], 0, "--max-batch-size"),
        (["fuse", "--help"], 0, "--members"),
    ],
)
def test_help_and_argument_errors_import_no_torch(argv, code, says):
    seen = _parse(argv)
    seen = _fresh(seen)
    assert seen["code"] == code
    assert says in seen["out"] + seen["err"]
    assert seen["loaded"] == [], f"hydra-ens {' '.join(argv)} imported {seen['loaded']}"


def test_a_commands_help_lists_the_scores_registered_when_it_is_shown():
    """The help of ``--flag-score`` names the live registry (imported for the help only)."""
    seen = _fresh(_parse(["predict", "--help"]))
    assert seen["code"] == 0
    text = " ".join(seen["out"].split())
    assert "the logit scores msp," in text and "mds_layers" in text and "<the registered" not in text


# the library imported first, then a saved model read by an Auto class, is also
# tests/serving/test_transformers.py's fresh process: that order here is CI's slow run
@pytest.mark.parametrize("first", [pytest.param("hydra_ensembles", marks=pytest.mark.slow), "transformers"])
def test_the_auto_classes_know_saved_models_in_either_import_order(first):
    """Importing the library registers its configuration with AutoConfig once transformers' Auto
    configuration loads, before or after the library."""
    order = ["import hydra_ensembles", "from transformers import AutoConfig"]
    order = order if first == "hydra_ensembles" else order[::-1]
    seen = _fresh(
        "import json\n" + "\n".join(order) + "\n"
        "from transformers import AutoConfig\n"
        "config = AutoConfig.for_model('hydra-ensembles', saved_format='fused')\n"
        "print(json.dumps({'type': type(config).__module__ + '.' + type(config).__name__}))"
    )
    assert seen["type"] == "hydra_ensembles.configuration.HydraConfig"
