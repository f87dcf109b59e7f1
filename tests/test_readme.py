"""The README's Python quick start and serving example, and the Python API page's examples, run as
written (on the real MiniLM-L6)."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_the_documented_python_examples_run(tmp_path, monkeypatch):
    readme, api = _python_blocks("README.md"), _python_blocks("docs/python-api.md")
    assert len(readme) == 2 and len(api) == 2, "the Python blocks changed: keep this test in step"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with torch.no_grad():
        exec(compile(readme[0], "README.md", "exec"), namespace)  # the quick start
    out = namespace["out"]
    assert out.member_logits.shape == (3, 1, 4) and out.probs.shape == (1, 4)
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
    assert saved.data == "bbc-news:val" and saved.examples == 16
    again = namespace["predict"](namespace["hydra"], namespace["ood_val"])
    assert namespace["records"] == saved.records(again, namespace["news"].classes)
    # the serving example, on that calibrated model saved as build saves it
    namespace["tokenizer"].save_pretrained(tmp_path / "built" / "hydra")
    namespace["hydra"].save_pretrained(tmp_path / "built" / "hydra")
    exec(compile(readme[1], "README.md", "exec"), namespace)
    served = namespace["uncertain"]("The match ended in a draw.")[0]
    assert {"flagged", "mutual_information", "ood_score_msp", "entropy"} <= set(served)
