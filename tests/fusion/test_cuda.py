"""On a CUDA GPU (skipped elsewhere): the fused model of every family equals its members run one by
one on the GPU, in fp32 and with the weights cast to bf16 and fp16, within the tolerances of
`rounding_tolerance`; fp32 on the GPU equals fp32 on the CPU; prediction under autocast on the GPU
returns fp32 probabilities that match the CPU's within the format's rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.evaluation import predict
from hydra_ensembles.precision import DTYPES
from tests.factories import FAMILIES, rounding_tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEAD_SETS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({0: [0], 1: [3]})]
"""Ragged members, a layer with no head, heads shared between members."""
TOL = 1e-4


def _on(inputs: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in inputs.items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_equals_its_members_on_cuda(family, precision):
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3).eval()
    x = inputs(batch=4, seed=1)
    with torch.no_grad():
        exact = torch.stack([he.prune(model, hs).eval()(**x).logits for hs in HEAD_SETS])
        cpu = he.fuse(model, HEAD_SETS).eval()(**x).member_logits
    tol = rounding_tolerance(precision, exact, layers=2, fp32=TOL)
    dtype = DTYPES[precision]
    gx = _on(x, "cuda")
    with torch.no_grad():
        fused = he.fuse(model, HEAD_SETS).eval().to("cuda", dtype)(**gx).member_logits
        members = [he.prune(model, hs).eval().to("cuda", dtype) for hs in HEAD_SETS]
        explicit = torch.stack([m(**gx).logits for m in members]).float().cpu()
    assert fused.dtype == dtype and fused.device.type == "cuda"
    fused = fused.float().cpu()
    assert torch.isfinite(fused).all()
    assert (fused - explicit).abs().max().item() <= tol
    assert (fused - exact).abs().max().item() <= tol
    if precision == "fp32":
        assert (fused - cpu).abs().max().item() <= TOL


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_prediction_under_autocast_on_cuda(precision):
    factory, inputs = FAMILIES["bert"]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3).eval()
    x = inputs(batch=4, seed=2)
    hydra = he.fuse(model, HEAD_SETS).eval()
    exact = predict(hydra, [x], progress=False, precision="fp32")
    out = predict(hydra.to("cuda"), [_on(x, "cuda")], progress=False, precision=precision)
    assert out.member_logits.dtype == exact.member_logits.dtype == np.float32
    tol = rounding_tolerance(precision, torch.as_tensor(exact.member_logits), layers=2, fp32=TOL)
    assert np.abs(out.member_logits - exact.member_logits).max() <= tol
    assert np.abs(out.probs() - exact.probs()).max() <= tol
