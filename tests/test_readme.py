"""The README's Python quick start runs as written (on the real MiniLM-L6)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_quick_start_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python quick start"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with torch.no_grad():
        exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.member_logits.shape == (3, 1, 4) and out.probs.shape == (1, 4)
    assert (tmp_path / "runs" / "readme-hydra" / "hydra_config.json").is_file()
    assert len(blocks) == 3, "the README's Python blocks changed: keep this test in step"
    exec(compile(blocks[1], "README.md", "exec"), namespace)  # scoring, members, fine-tuning, evaluation
    assert len(namespace["order"].removed) == 4
    assert namespace["preds"].member_logits.shape == (3, 16, 4)
    assert 0 <= namespace["report"]["classification"]["acc"] <= 1
    records = namespace["records"]  # per-input records for serving
    assert len(records) == 16 and isinstance(records[0]["flagged"], bool)
    assert records[0]["predicted"] in namespace["news"].classes
    exec(compile(blocks[2], "README.md", "exec"), namespace)  # the calibration saved with the model
    saved = namespace["calibration"]
    assert saved.data == "bbc-news:val" and saved.examples == 16
    again = namespace["predict"](namespace["hydra"], namespace["ood_val"])
    assert namespace["records"] == saved.records(again, namespace["news"].classes)
