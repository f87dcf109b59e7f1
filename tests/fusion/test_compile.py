"""torch.compile of a fused model (with inference freezing, as docs/benchmarks.md suggests) gives
the eager model's outputs, shared trunk included."""

import shutil

import pytest
import torch

import hydra_ensembles as he
from tests.factories import text_inputs, tiny_bert

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.slow  # about 40 s of compilation: .ci/run runs it
@pytest.mark.skipif(not HAS_CXX, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_hydra_matches_eager(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "freezing", True)
    model = tiny_bert()
    head_sets = [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({0: [0, 1, 2], 1: [1]})]  # a one-layer trunk
    hydra = he.fuse(model, head_sets).eval()
    assert hydra.trunk_layers == 1
    compiled = torch.compile(hydra)
    x = text_inputs()
    with torch.inference_mode():
        eager, fast = hydra(**x), compiled(**x)
    assert type(fast) is type(eager)
    torch.testing.assert_close(fast.member_logits, eager.member_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.probs, eager.probs, rtol=1e-4, atol=1e-5)
