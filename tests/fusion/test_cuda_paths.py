"""On a CUDA GPU (skipped elsewhere): the fused model equals its members run one by one under each
of PyTorch's attention kernels (flash, memory-efficient, math) on the member-stacked batch, with
padding masks where the kernel takes one; a shared trunk and a dual encoder fused on the GPU equal
their explicit members; a model saved from the GPU loads on the CPU with the same outputs; feature
statistics, flags and conformal sets fitted on the GPU equal the CPU's; circuit extraction on the
GPU removes the heads it removes on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hydra_ensembles as he
from hydra_ensembles.batching import on_device
from hydra_ensembles.calibration import calibrate
from hydra_ensembles.precision import dtype_of
from hydra_ensembles.scoring import extract_circuit
from hydra_ensembles.zero_shot import fuse_dual_encoder
from tests.factories import (
    image_inputs,
    labelled,
    rounding_tolerance,
    text_inputs,
    tiny_bert,
    tiny_clip_zero_shot,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RAGGED = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({0: [0], 1: [3]})]
"""Ragged members, a layer with no head, heads shared between members."""
TRUNK = [he.HeadSet({0: [0, 1], 1: [2]}), he.HeadSet({0: [0, 1], 1: [0, 3]}), he.HeadSet({0: [0, 1], 1: [1]})]
"""Members that share their first layer's heads: fused with a shared trunk of one layer."""
KERNELS = {
    "flash": (SDPBackend.FLASH_ATTENTION, ("bf16", "fp16"), False),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, ("fp32", "bf16", "fp16"), True),
    "math": (SDPBackend.MATH, ("fp32", "bf16", "fp16"), True),
}
"""Kernel -> (backend, precisions it computes in, whether it takes a padding mask)."""
CASES = [(k, p) for k, (_, precisions, _) in KERNELS.items() for p in precisions]


def _explicit(model, head_sets, x, dtype):
    members = [he.prune(model, hs).eval().to("cuda", dtype) for hs in head_sets]
    return torch.stack([m(**x).logits for m in members]).float().cpu()


@pytest.mark.parametrize(("kernel", "precision"), CASES)
def test_fused_equals_members_under_each_attention_kernel(kernel, precision):
    """Only the named kernel may run (`sdpa_kernel` raises where it cannot): flash takes no mask,
    so its batch is unpadded; the others read a padded batch of ragged rows."""
    backend, _, masked = KERNELS[kernel]
    model = tiny_bert(layers=2, heads=4, head_dim=16, init_range=0.3, dropout=0.0).eval()
    x = text_inputs(batch=6, tokens=11, seed=4, padded=masked)
    if not masked:
        x.pop("attention_mask")
    dtype = dtype_of(precision)
    with torch.no_grad():
        exact = torch.stack([he.prune(model, hs).eval()(**x).logits for hs in RAGGED])
        fused_model = he.fuse(model, RAGGED).eval().to("cuda", dtype)
        gx = on_device(x, "cuda")
        with sdpa_kernel([backend]):
            fused = fused_model(**gx).member_logits.float().cpu()
            explicit = _explicit(model, RAGGED, gx, dtype)
    tol = rounding_tolerance(precision, exact, layers=2, fp32=1e-4)
    assert torch.isfinite(fused).all()
    assert (fused - explicit).abs().max().item() <= tol
    assert (fused - exact).abs().max().item() <= tol


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_shared_trunk_fused_on_the_gpu_equals_its_members(precision):
    model = tiny_bert(layers=2, heads=4, head_dim=8, init_range=0.3, dropout=0.0).eval()
    x = text_inputs(batch=4, tokens=9, seed=5)
    dtype = dtype_of(precision)
    with torch.no_grad():
        exact = torch.stack([he.prune(model, hs).eval()(**x).logits for hs in TRUNK])
        fused_model = he.fuse(model, TRUNK).eval().to("cuda", dtype)
        assert fused_model.trunk_layers == 1
        fused = fused_model(**on_device(x, "cuda")).member_logits.float().cpu()
    tol = rounding_tolerance(precision, exact, layers=2, fp32=1e-4)
    assert (fused - exact).abs().max().item() <= tol


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dual_encoder_fused_on_the_gpu_equals_its_members(precision):
    model = tiny_clip_zero_shot(classes=3, templates=2).eval()
    head_sets = [he.HeadSet({0: [0, 1], 3: []}), he.HeadSet({1: [2], 2: [0]}), he.HeadSet({1: [0, 3]})]
    x = image_inputs(4, seed=6)
    dtype = dtype_of(precision)
    with torch.no_grad():
        exact = torch.stack([he.prune(model, hs)(**x).logits for hs in head_sets])
        fused = fuse_dual_encoder(model, head_sets).eval().to("cuda", dtype)
        out = fused(**on_device(x, "cuda")).member_logits.float().cpu()
    tol = rounding_tolerance(precision, exact, layers=4, fp32=1e-4)
    assert (out - exact).abs().max().item() <= tol


def test_a_model_saved_from_the_gpu_loads_on_the_cpu_with_the_same_outputs(tmp_path):
    model = tiny_bert(layers=2, heads=4, head_dim=4, init_range=0.3).eval()
    on_cpu = he.fuse(model, RAGGED).eval()
    on_cpu.to("cuda").save_pretrained(tmp_path / "hydra")
    loaded = he.HydraModel.from_pretrained(tmp_path / "hydra")
    assert next(loaded.parameters()).device.type == "cpu"
    x = text_inputs(batch=4, seed=7)
    with torch.no_grad():
        assert torch.equal(loaded(**x).member_logits, on_cpu.cpu()(**x).member_logits)


@pytest.mark.parametrize("score", ["mds", "knn", "mds_layers", "mds_disagreement"])
def test_feature_statistics_flags_and_sets_fitted_on_the_gpu_equal_the_cpus(score):
    """`calibrate` on a GPU model and GPU batches (fp32) fits the same statistics, threshold and
    conformal set quantile as on the CPU, within float rounding."""
    model = tiny_bert(layers=2, heads=4, head_dim=4, init_range=0.3).eval()
    train = [labelled(text_inputs(batch=40, seed=s), labels=3, seed=s) for s in (10, 11)]
    val = [labelled(text_inputs(batch=40, seed=s), labels=3, seed=s) for s in (12, 13)]
    fitted = {}
    for device in ("cpu", "cuda"):
        fused = he.fuse(model, RAGGED).eval().to(device)
        fitted[device] = calibrate(
            fused,
            [on_device(b, device) for b in val],
            score=score,
            keep=0.9,
            precision="fp32",
            progress=False,
            id_train=[on_device(b, device) for b in train],
            set_method="lac",
        )
    cpu, gpu = fitted["cpu"], fitted["cuda"]
    assert np.isclose(gpu.flag.threshold, cpu.flag.threshold, rtol=1e-4, atol=1e-5)
    assert np.isclose(gpu.temperature, cpu.temperature, rtol=1e-3)
    assert np.allclose(gpu.sets.quantiles, cpu.sets.quantiles, rtol=1e-3, atol=1e-5)
    assert np.allclose(gpu.flag.calibration_scores, cpu.flag.calibration_scores, rtol=1e-3, atol=1e-5)
    assert gpu.flag.statistics is not None and gpu.flag.statistics_sha256


@pytest.mark.parametrize("objective", ["acc", "ood", "avg"])
def test_circuit_extraction_on_the_gpu_removes_the_cpus_heads(objective):
    model = tiny_bert(layers=2, heads=4, head_dim=8, init_range=0.3, dropout=0.0).eval()
    id_val = [labelled(text_inputs(batch=12, seed=20), labels=3, seed=20)]
    ood_val = [text_inputs(batch=12, seed=21)]
    orders = {}
    for device in ("cpu", "cuda"):
        on = model.to(device)
        order = extract_circuit(
            on, [on_device(b, device) for b in id_val], [on_device(b, device) for b in ood_val],
            budget=4, objective=objective, precision="fp32", progress=False,
        )  # fmt: skip
        orders[device] = order.removed
    assert orders["cuda"] == orders["cpu"]


def test_predict_feeds_cpu_batches_to_a_gpu_model():
    """Batches made on the CPU (as the data loaders make them) are moved to the model's device."""
    from hydra_ensembles.evaluation import predict

    model = tiny_bert(layers=2, heads=4, head_dim=4, init_range=0.3).eval()
    hydra = he.fuse(model, RAGGED).eval()
    x = [labelled(text_inputs(batch=4, seed=30), labels=3, seed=30)]
    on_cpu = predict(hydra, x, progress=False, precision="fp32")
    on_gpu = predict(hydra.to("cuda"), x, progress=False, precision="fp32")
    assert np.allclose(on_gpu.member_logits, on_cpu.member_logits, atol=1e-4)
    assert np.allclose(on_gpu.member_features, on_cpu.member_features, atol=1e-4)
