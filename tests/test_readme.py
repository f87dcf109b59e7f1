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
