"""A score an installed package registers (docs/ood.md, "Adding a feature score"): the page's
module, installed as a package with a ``hydra_ensembles.scores`` entry point, in a fresh process
that never imports it by name, is fit by finetune and calibrate, weighed by the flag rule,
accepted by ``--flag-score``, saved, and served alike by predict, the text pipeline and the ONNX
graph."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_ensembles.evaluation import Predictions, choose_flag_score
from hydra_ensembles.evaluation.flag_score import validation_aurocs
from hydra_ensembles.ood import FeatureStatistics, registry
from tests.ood.test_registry import PAGE

ROOT = Path(__file__).resolve().parents[2]


def _page_module() -> str:
    """The module of the page's "Adding a feature score" section (its first, fit in one process)."""
    text = PAGE.read_text().split("## Adding a feature score", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


def _install(site: Path) -> None:
    """The page's module as an installed package: the module, and the distribution's metadata
    that declares its entry point (what ``pip install`` of a package with the page's
    ``pyproject.toml`` table leaves in site-packages)."""
    (site / "hydra_norm_score.py").write_text(_page_module())
    meta = site / "hydra_norm_score-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: hydra-norm-score\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[hydra_ensembles.scores]\nnorm = hydra_norm_score\n")


CHILD = """
import json, sys
from pathlib import Path

import numpy as np
import pytest
import onnxruntime
import torch
from transformers import AutoTokenizer, pipeline

from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.loading import load_any
from hydra_ensembles.precision import resolve_precision
from hydra_ensembles.serving.onnx import TOLERANCE
from tests.cli.test_pipeline import _model_and_tokenizer
from tests.factories import computing_in, rounding_tolerance

assert "hydra_norm_score" in sys.modules  # loaded through its entry point: nothing here names it
w = Path(sys.argv[1])
_model_and_tokenizer("bert", w / "model")
common = ["--batch-size", "8", "--max-length", "12"]
data = ["--data", str(w / "train.csv"), "--val-data", str(w / "train.csv")]
tuned = w / "tuned"
args = ["finetune", str(w / "model"), *data, "--ood-data", str(w / "ood.csv"), "--epochs", "1"]
assert main([*args, "--out", str(tuned), *common]) == 0
assert "norm.mean" in saved_calibration(load_any(str(tuned))).flag.statistics.tensors  # fit with the others
normed = w / "normed"
args = ["calibrate", str(tuned), *data, "--ood-data", str(w / "ood.csv"), "--flag-score", "norm"]
assert main([*args, "--out", str(normed), *common]) == 0
calibration = saved_calibration(load_any(str(normed)))
assert calibration.flag.score == "norm"
out = w / "p.jsonl"
assert main(["predict", str(normed), "--data", str(w / "ood.csv"), "--out", str(out), *common]) == 0
rows = [json.loads(line) for line in out.read_text().splitlines()]
scores = [r["ood_score_norm"] for r in rows]
precision = resolve_precision("auto", "cpu").name
tol = rounding_tolerance(precision, torch.tensor(scores), layers=2)
served = pipeline("hydra-text-classification", model=str(normed), truncation=True, max_length=12)
with computing_in(precision):
    records = served([r["text"] for r in rows], batch_size=3)
assert np.allclose([r["ood_score_norm"] for r in records], scores, rtol=0, atol=tol)
clear = [i for i, s in enumerate(scores) if abs(s - calibration.flag.threshold) > tol]
assert [records[i]["flagged"] for i in clear] == [rows[i]["flagged"] for i in clear]
onnx = w / "onnx"
assert main(["export", str(normed), "--format", "onnx", "--out", str(onnx)]) == 0
side = json.loads((onnx / "calibration.json").read_text())
encoded = AutoTokenizer.from_pretrained(onnx)(
    [r["text"] for r in rows], padding=True, truncation=True, max_length=12, return_tensors="np"
)
feed = {name: encoded[name].astype("int64") for name in side["inputs"]}
(graph,) = onnxruntime.InferenceSession(str(onnx / "model.onnx")).run(["ood_score"], feed)
assert np.allclose(graph, scores, rtol=0, atol=tol + TOLERANCE * max(abs(s) for s in scores))
print("served alike:", len(rows), "rows")
"""


@pytest.mark.slow  # fresh processes through every command (14 s): CI's slow run
def test_an_installed_score_is_fit_chosen_saved_and_served_in_a_fresh_process_in_fp32(tmp_path):
    """In fp32: what is checked is the registry's reach; the precisions' paths are the built-in
    scores' (tests/serving/test_feature_scores.py)."""
    site = tmp_path / "site"
    site.mkdir()
    _install(site)
    rows = [f"goal match team score {i},sport" for i in range(12)]
    rows += [f"bank shares market profit {i},money" for i in range(12)]
    (tmp_path / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    ood = [f"recipe with flour {i}" for i in range(10)]
    (tmp_path / "ood.csv").write_text("text\n" + "\n".join(ood) + "\n")
    path = os.pathsep.join([str(site), str(ROOT)])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYDRA_PRECISION": "fp32", "PYTHONPATH": path}
    prelude = (
        "from tests.precision_use import record_from_environment\nrecord_from_environment()\n"
        f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(CHILD), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served alike: 10 rows" in done.stdout
    assert re.search(r"^\s*norm\b", done.stdout, flags=re.M), done.stdout  # weighed among the candidates


def _shell(rng, n, radius, width=6):
    """``n`` features on a sphere of ``radius`` (random directions) and random logits."""
    u = rng.normal(size=(1, n, width))
    features = radius * u / np.linalg.norm(u, axis=-1, keepdims=True)
    return features, rng.normal(size=(1, n, 3))


def test_the_flag_rule_chooses_a_registered_score_where_it_separates_best():
    """ID features on a sphere, OOD features on a smaller one, logits alike: the distance to the
    training features' mean length separates them (AUROC 1), every other score less well, and the
    rule chooses it; without it registered, the rule chooses among the others."""
    exec(compile(_page_module(), str(PAGE), "exec"), {})
    try:
        rng = np.random.default_rng(0)
        (train, _), y = _shell(rng, 300, 5.0), np.arange(300) % 3
        val, val_logits = _shell(rng, 200, 5.0)
        ood, ood_logits = _shell(rng, 200, 1.0)
        stats = FeatureStatistics.fit(train, y, 3)
        assert "norm" in stats.scores  # fit by default, as every registered score is
        id_val = Predictions(val_logits, np.arange(200) % 3, val)
        ood_val = Predictions(ood_logits, None, ood)
        aurocs = validation_aurocs(id_val, ood_val, stats)
        assert aurocs["norm"] == 1.0 and max(a for s, a in aurocs.items() if s != "norm") < 1.0
        assert choose_flag_score(id_val, stats, ood_val) == "norm"
    finally:
        registry._REGISTRY.pop("norm", None)
    assert "norm" not in registry.feature_scores()
    assert choose_flag_score(id_val, FeatureStatistics.fit(train, y, 3), ood_val) != "norm"
