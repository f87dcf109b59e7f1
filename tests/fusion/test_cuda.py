"""On a CUDA GPU (skipped elsewhere): the fused model of every family equals its members run one by
one on the GPU, in fp32 and with the weights cast to bf16 and fp16, within the tolerances of
`rounding_tolerance`; fp32 on the GPU equals fp32 on the CPU; prediction under autocast on the GPU
returns fp32 probabilities that match the CPU's within the format's rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.batching import on_device
from hydra_ensembles.evaluation import predict
from hydra_ensembles.precision import dtype_of
from tests.factories import FAMILIES, rounding_tolerance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEAD_SETS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({0: [0], 1: [3]})]
"""Ragged members, a layer with no head, heads shared between members."""
TOL = 1e-4


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
    dtype = dtype_of(precision)
    gx = on_device(x, "cuda")
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
    out = predict(hydra.to("cuda"), [on_device(x, "cuda")], progress=False, precision=precision)
    assert out.member_logits.dtype == exact.member_logits.dtype == np.float32
    tol = rounding_tolerance(precision, torch.as_tensor(exact.member_logits), layers=2, fp32=TOL)
    assert np.abs(out.member_logits - exact.member_logits).max() <= tol
    assert np.abs(out.probs() - exact.probs()).max() <= tol


_TRAIN_ON_THE_GPU = """
import json, torch
from hydra_ensembles.training import FineTuneConfig, fine_tune
from tests.factories import FAMILIES, labelled
factory, inputs = FAMILIES["bert"]
model = factory(layers=2, heads=4, head_dim=3)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
data = [labelled(inputs(batch=4, seed=s), seed=s) for s in range(3)]
during = []
for epochs in (2, 1):  # a model fine-tuned before is placed on the GPU again
    fine_tune(model, data, data[:1], FineTuneConfig(epochs=epochs, lr=1e-2, warmup=0.0), progress=False,
              on_epoch=lambda record: during.append(next(model.parameters()).device.type))
after = {next(model.parameters()).device.type}
changed = sum(not torch.equal(p, before[n]) for n, p in model.named_parameters())
print(json.dumps({"during": during, "after": sorted(after), "changed": changed}))
"""


def test_fine_tuning_trains_on_the_gpu_and_returns_the_model_where_it_was():
    """Accelerate trains on the GPU, a second time too; the model comes back on the CPU it came
    from, so what follows (fusion, calibration, saving) meets no tensor on another device."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", _TRAIN_ON_THE_GPU]
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=True)
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["during"] == ["cuda", "cuda", "cuda"]
    assert record["after"] == ["cpu"] and record["changed"] > 0
