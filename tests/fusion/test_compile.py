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


@pytest.mark.parametrize("exporting_says", [None, True])
@pytest.mark.parametrize("trunk", [False, True])
def test_a_fused_model_compiles_to_one_graph_with_its_features(trunk, exporting_says, monkeypatch):
    """No graph break: a break splits the pass into pieces run eagerly between them, which keeps
    CUDA graphs (``mode="reduce-overhead"``) from capturing the pass (the fused model then ran
    3.8x slower than eager on a GPU). The members' features are still recorded, as in eager.
    Also where ``torch.compiler.is_exporting()`` is true under ``torch.compile`` (torch 2.11)."""
    if exporting_says is not None:
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: exporting_says)
    model = tiny_bert()
    head_sets = [he.HeadSet({0: [0, 1, 2]}), he.HeadSet({0: [0, 1, 2] if trunk else [3], 1: [1]})]
    hydra = he.fuse(model, head_sets).eval()
    assert hydra.trunk_layers == int(trunk)
    x = text_inputs()
    with torch.no_grad():
        explained = torch._dynamo.explain(hydra)(**x)
        eager = hydra(**x)
        traced = torch.compile(hydra, backend="eager", fullgraph=True)(**x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert eager.member_features is not None
    torch.testing.assert_close(traced.member_features, eager.member_features)
    torch.testing.assert_close(traced.member_logits, eager.member_logits)
