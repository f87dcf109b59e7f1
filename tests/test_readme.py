"""The README's Python quick start and serving example, and the Python API page's examples, run as
written (on the real MiniLM-L6)."""

import re
from pathlib import Path

import pytest
import torch

from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_classifier, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_the_documented_python_examples_run(tmp_path, monkeypatch):
    readme, api = _python_blocks("README.md"), _python_blocks("docs/python-api.md")
    assert len(readme) == 3 and len(api) == 5, "the Python blocks changed: keep this test in step"
    monkeypatch.chdir(tmp_path)
    # the quick start on one's own CSV: a classifier `finetune` made, train.csv and val.csv
    classifier = load_classifier("minilm-l6", num_labels=2)
    classifier.config.id2label, classifier.config.label2id = (
        {0: "money", 1: "sport"},
        {"money": 0, "sport": 1},
    )
    classifier.save_pretrained(tmp_path / "tuned")
    load_tokenizer().save_pretrained(tmp_path / "tuned")
    for name, n in (("train.csv", 8), ("val.csv", 6)):
        rows = [f"goal match team {i},sport" for i in range(n)] + [f"bank shares {i},money" for i in range(n)]
        (tmp_path / name).write_text("text,label\n" + "\n".join(rows) + "\n")
    csv_namespace: dict = {}
    exec(compile(readme[0], "README.md", "exec"), csv_namespace)
    built = csv_namespace["built"]
    assert built.calibration is not None and len(built.members) == 3
    assert load_any(str(tmp_path / "built" / "hydra")).config.id2label == {0: "money", 1: "sport"}
    namespace: dict = {}
    with torch.no_grad():
        exec(compile(readme[1], "README.md", "exec"), namespace)  # the building blocks
    out = namespace["out"]
    assert out.member_logits.shape == (3, 1, 4) and out.probs.shape == (1, 4)
    assert out.member_features.shape == (3, 1, 384)
    assert (tmp_path / "runs" / "readme-hydra" / "hydra_config.json").is_file()
    exec(compile(api[0], "docs/python-api.md", "exec"), namespace)  # scoring, members, evaluation
    assert len(namespace["order"].removed) == 4
    assert namespace["preds"].member_logits.shape == (3, 16, 4)
    assert 0 <= namespace["report"]["classification"]["acc"] <= 1
    records = namespace["records"]  # per-input records for serving
    assert len(records) == 16 and isinstance(records[0]["flagged"], bool)
    assert records[0]["predicted"] in namespace["news"].classes
    exec(compile(api[1], "docs/python-api.md", "exec"), namespace)  # the calibration saved with the model
    saved = namespace["calibration"]
    assert saved.provenance.validation.name == "bbc-news:val" and saved.examples == 16
    again = namespace["predict"](namespace["hydra"], namespace["ood_val"])
    assert namespace["records"] == saved.records(again, namespace["news"].classes)
    exec(compile(api[2], "docs/python-api.md", "exec"), namespace)  # feature scores
    feature = namespace["calibration"]
    assert feature.flag.statistics is not None and feature.provenance.statistics.name == "bbc-news:train"
    assert namespace["preds"].member_features.shape == (3, 16, 384)
    exec(compile(api[3], "docs/python-api.md", "exec"), namespace)  # one record of the settings
    strict = namespace["calibration"]
    assert (strict.flag.score, strict.flag.keep, strict.sets.method, strict.sets.alpha) == (
        "mds",
        0.9,
        "aps",
        0.2,
    )
    assert strict.sets.quantiles and strict.flag.statistics is not None
    # the serving example, on what the CSV quick start built
    exec(compile(readme[2], "README.md", "exec"), namespace)
    served = namespace["uncertain"]("The match ended in a draw.")[0]
    assert {"flagged", "mutual_information", "ood_score_mds", "ood_score_mds_spread", "entropy"} <= set(
        served
    )


def test_the_documented_experiments_example_names_what_exists():
    """The experiments block runs a whole demo (tests/experiments runs reduced ones): here it is
    compiled, and what it uses exists with the arguments it passes."""
    import inspect

    import hydra_experiments

    block = _python_blocks("docs/python-api.md")[4]
    compile(block, "docs/python-api.md", "exec")
    config = hydra_experiments.DemoConfig.preset("text", out_dir="runs/my-demo")
    cache = hydra_experiments.Cache(config.cache_dir, enabled=True)
    assert cache.built == [] and "cache" in inspect.signature(hydra_experiments.run_demo).parameters
