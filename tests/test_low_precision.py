"""bf16 and fp16, the precisions most users compute in: the fused model, zero-shot Hydra and
prediction agree with the explicit computation (members run one by one) in the same precision
and with fp32, within tolerances derived from the format's rounding (`rounding_tolerance`), both
under autocast (`precision="bf16"`) and with the weights cast (``model.to(torch.bfloat16)``).

Tiny models: bf16 is emulated on CPUs without AVX-512 BF16 or AMX, slow on large models only.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.evaluation import predict
from hydra_ensembles.precision import dtype_of
from hydra_ensembles.zero_shot import fuse_dual_encoder
from tests.factories import (
    FAMILIES,
    computing_in,
    image_inputs,
    rounding_tolerance,
    text_inputs,
    tiny_clip_zero_shot,
    tiny_sentence_zero_shot,
)

LOW = ("bf16", "fp16")
HEAD_SETS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({0: [0], 1: [3]})]
"""Ragged members, a layer with no head, heads shared between members."""
LOW_PRECISION_FAMILIES = [
    "bert",
    "mpnet",
    "vit",
    "clip",
    "deberta-v3",
    "modernbert",
    "llama",
    "qwen3",
    "gemma2",
]
"""A family of each attention kind: BERT's, per-head biases, vision, disentangled, packed Q/K/V
with rotary embeddings, grouped-query (with q/k norms, with soft-capped scores)."""


def _members(model, dtype=None):
    members = [he.prune(model, hs).eval() for hs in HEAD_SETS]
    return [m.to(dtype) for m in members] if dtype is not None else members


@pytest.mark.parametrize("way", ["autocast", "cast"])
@pytest.mark.parametrize("precision", LOW)
@pytest.mark.parametrize("family", LOW_PRECISION_FAMILIES)
def test_fused_model_equals_its_members_in_low_precision(family, precision, way):
    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    x = inputs(batch=4, seed=1)  # text: padded rows, so masks meet MPNet's position bias
    with torch.no_grad():
        exact = torch.stack([m(**x).logits for m in _members(model)])
    tol = rounding_tolerance(precision, exact, layers=2, fp32=0.0)
    hydra = he.fuse(model, HEAD_SETS).eval()
    if way == "autocast":
        out = torch.as_tensor(predict(hydra, [x], progress=False, precision=precision).member_logits)
        with torch.no_grad(), computing_in(precision):
            explicit = torch.stack([m(**x).logits.float() for m in _members(model)])
    else:
        dtype = dtype_of(precision)
        with torch.no_grad():
            out = hydra.to(dtype)(**x).member_logits
            assert out.dtype == dtype
            explicit = torch.stack([m(**x).logits for m in _members(model, dtype)]).float()
        out = out.float()
    assert torch.isfinite(out).all()
    assert (out - explicit).abs().max().item() <= tol  # the same computation, rounded elsewhere
    assert (out - exact).abs().max().item() <= tol  # and fp32's, within the format's rounding


@pytest.mark.parametrize("way", ["autocast", "cast"])
@pytest.mark.parametrize("precision", LOW)
@pytest.mark.parametrize(
    ("make", "inputs"),
    [
        (tiny_clip_zero_shot, image_inputs),
        (tiny_sentence_zero_shot, text_inputs),
        (functools.partial(tiny_sentence_zero_shot, encoder="mpnet"), text_inputs),
    ],
    ids=["clip", "sentence", "mpnet-sentence"],
)
def test_zero_shot_hydra_runs_in_low_precision_and_returns_fp32_cosines(make, inputs, precision, way):
    """A ZeroShotHydra cast to bf16/fp16, or run under autocast, meets its cached class embeddings
    in fp32 (`cosine_logits`): fp32 logits within rounding of the fp32 model's."""
    model = make(classes=3, templates=2, heads_pool="both")
    head_sets = [he.HeadSet({0: [0, 1], 1: [2], 3: [0]}), he.HeadSet({0: [0, 1], 1: [], 3: [1]})]
    fused = fuse_dual_encoder(model, head_sets)
    x = inputs(5, seed=2)
    with torch.no_grad():
        exact = fused(**x).member_logits
        if way == "autocast":
            with computing_in(precision):
                out = fused(**x).member_logits
        else:
            out = fused.to(dtype_of(precision))(**x).member_logits
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    layers = 2  # each tower's depth: the two towers' errors meet in one cosine
    tol = rounding_tolerance(precision, exact, layers=2 * layers, fp32=0.0)
    assert (out - exact).abs().max().item() <= tol


def test_fp32_prediction_of_a_bf16_model_computes_in_fp32():
    """Autocast never upcasts: ``predict(precision="fp32")`` of bf16 weights runs an fp32 copy."""
    factory, inputs = FAMILIES["bert"]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3).to(torch.bfloat16)
    x = inputs(batch=4)
    got = predict(model, [x], progress=False, precision="fp32").member_logits
    with torch.no_grad():
        expected = model.float()(**x).logits.numpy()
    assert next(model.parameters()).dtype == torch.float32  # (cast here, after predict's own copy)
    np.testing.assert_array_equal(got[0], expected)


def test_fp16_mask_plus_position_bias_never_makes_nan():
    """fp16's most negative mask value (-65504) plus MPNet's negative position bias rounds to -inf;
    padded rows must still give finite outputs, in the model and in its fused form."""
    factory, _ = FAMILIES["mpnet"]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.weight.shape[-1] == 4:
                module.weight.fill_(-40.0)  # a position bias far below -16 everywhere
    x = text_inputs(batch=4, tokens=9, seed=3)
    hydra = he.fuse(model, HEAD_SETS).eval().half()
    with torch.no_grad():
        single = model.half()(**x).logits
        fused = hydra(**x).member_logits
    assert torch.isfinite(single).all() and torch.isfinite(fused).all()


FULL_ENSEMBLE_FAMILIES = ["bert", "distilbert", "mpnet", "modernbert", "vit", "llama"]
"""A family of each attention layout (BERT's, W_O inside attention, per-head biases, packed Q/K/V with
rotary embeddings, vision, grouped-query) whose members train in full or by LoRA."""


@pytest.mark.parametrize("precision", ["fp32", *LOW])
@pytest.mark.parametrize("kind", ["deep", "lora"])
@pytest.mark.parametrize("family", FULL_ENSEMBLE_FAMILIES)
def test_a_fused_deep_or_lora_ensemble_equals_its_members_in_every_precision(family, kind, precision):
    """Members that keep every head, apart everywhere (a deep ensemble) or only where LoRA trains
    them (the rest one shared module in the fused model), fused with exact parts: their explicit
    ensemble, exactly in fp32 and within the format's rounding in bf16 and fp16 (weights cast),
    on padded rows."""
    from hydra_ensembles.baselines.lora import lora_parts
    from hydra_experiments.bench_methods import distinct_members

    factory, inputs = FAMILIES[family]
    model = factory(layers=2, heads=4, head_dim=3, init_range=0.3)
    trained = None if kind == "deep" else lora_parts(model)  # apart everywhere, or where LoRA trains
    members = distinct_members(model.eval(), 3, trained, scale=0.05)
    x = inputs(batch=4, seed=1)
    with torch.no_grad():
        exact = torch.stack([m(**x).logits for m in members])
    tol = rounding_tolerance(precision, exact, layers=2, fp32=1e-5)
    hydra = he.fuse(members, mlp="exact").eval()
    dtype = dtype_of(precision)
    with torch.no_grad():
        out = hydra.to(dtype)(**x).member_logits.float()
        explicit = torch.stack([m.to(dtype)(**x).logits for m in members]).float()
    assert torch.isfinite(out).all()
    assert (out - explicit).abs().max().item() <= tol
    assert (out - exact).abs().max().item() <= tol
    shared = sum(p.numel() for p in hydra.parameters()) < sum(
        p.numel() for m in members for p in m.parameters()
    )
    assert shared == (kind == "lora")  # LoRA members' frozen parts are held once
