"""Saved models through transformers' Auto classes and pipelines, against explicit computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    ViTImageProcessor,
    pipeline,
)

import hydra_ensembles as he
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.evaluation import Predictions, predict
from hydra_ensembles.evaluation.uncertainty import per_example
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.serving import HydraForSequenceClassification, HydraPreTrainedModel

from ..factories import rounding_tolerance
from .conftest import CLASSES, HEAD_SETS, TEXTS, tiny_image_classifier, tiny_text_classifier


def _explicit_probs(model, inputs, temperature=1.0):
    """The mean of the members' softmaxes at ``temperature``, members run one by one."""
    members = model.members if hasattr(model, "members") else [model]
    with torch.no_grad():
        return torch.stack([(m(**inputs).logits / temperature).softmax(-1) for m in members]).mean(0)


def _inputs(folder, texts=TEXTS):
    return dict(load_tokenizer(str(folder))(texts, padding=True, return_tensors="pt"))


@pytest.mark.parametrize("kind", ["calibrated", "fused", "member", "ensemble"])
def test_auto_model_gives_the_calibrated_ensemble_probabilities_in_fp32(saved, kind, monkeypatch):
    monkeypatch.setenv("HYDRA_PRECISION", "fp32")  # compared with fp32 computations by hand
    folder = saved[kind]
    assert AutoConfig.from_pretrained(folder).model_type == "hydra-ensembles"
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert isinstance(model, HydraForSequenceClassification)
    assert model.config.id2label == CLASSES
    library = load_any(str(folder))
    calibration = saved_calibration(library)
    assert (calibration is None) == (kind in ("fused", "member"))
    temperature = calibration.temperature if calibration else 1.0
    assert model.temperature == temperature
    x = _inputs(folder)
    with torch.no_grad():
        out = model(**x)
    if kind in ("calibrated", "fused"):  # the fused model's own member logits
        with torch.no_grad():
            expected = (library(**x).member_logits / temperature).softmax(-1).mean(0)
    else:  # members run one by one
        expected = _explicit_probs(library, x, temperature)
    assert torch.allclose(out.logits.softmax(-1), expected, atol=1e-6)
    members = 1 if kind == "member" else len(HEAD_SETS)
    assert out.logits_per_member.shape == (len(TEXTS), members, len(CLASSES))


def test_the_fused_model_served_equals_its_members_run_one_by_one_in_fp32(saved, monkeypatch):
    monkeypatch.setenv("HYDRA_PRECISION", "fp32")  # compared with fp32 computations by hand
    model = AutoModelForSequenceClassification.from_pretrained(saved["calibrated"])
    ensemble = load_any(str(saved["ensemble"]))  # the same pruned members, unfused
    x = _inputs(saved["calibrated"])
    with torch.no_grad():
        served = model(**x).logits_per_member.transpose(0, 1)
        explicit = torch.stack([m(**x).logits for m in ensemble.members])
    # exact fusion of attention; the MLPs are merged (identical here: one base, no fine-tuning)
    assert torch.allclose(served, explicit, atol=1e-5)


def test_the_uncertainty_pipeline_returns_the_records_predict_writes(saved):
    folder = saved["calibrated"]
    classify = pipeline("hydra-text-classification", model=str(folder))
    records = classify(TEXTS, batch_size=3)
    library = load_any(str(folder))
    calibration = saved_calibration(library)
    expected = calibration.records(
        predict(library, [_inputs(folder)], progress=False), list(CLASSES.values())
    )
    assert len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert got["label"] == want["predicted"] and got["score"] == pytest.approx(
            want["confidence"], abs=1e-6
        )
        assert set(got) == {"label", "score", *want}
        for key, value in want.items():
            assert got[key] == (value if isinstance(value, (str, bool)) else pytest.approx(value, abs=1e-6))
    assert {"flagged", "mutual_information", "ood_score_msp"} <= set(records[0])
    # the standard task gives the same calibrated probability of the predicted class
    standard = pipeline("text-classification", model=str(folder))(TEXTS)
    assert [r["label"] for r in standard] == [r["label"] for r in records]
    assert [r["score"] for r in standard] == pytest.approx([r["score"] for r in records], abs=1e-6)


def test_the_uncertainty_pipeline_serves_a_plain_classifier_as_an_ensemble_of_one(saved, tmp_path):
    plain = tiny_text_classifier_saved(tmp_path)
    records = pipeline("hydra-text-classification", model=str(plain))(TEXTS[:2])
    assert "mutual_information" not in records[0] and "flagged" not in records[0]
    loaded = load_any(str(plain))
    predictions = predict(loaded, [_inputs(plain, TEXTS[:2])], progress=False)
    expected = per_example(predictions, list(CLASSES.values()))
    assert [r["confidence"] for r in records] == pytest.approx([r["confidence"] for r in expected], abs=1e-6)


class _LinearDtypes:
    """Records the dtype every nn.Linear of a model computes in (autocast sets it)."""

    def __init__(self, model):
        self.seen: set[torch.dtype] = set()
        self.handles = [
            m.register_forward_hook(lambda _m, _i, out: self.seen.add(out.dtype))
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        ]

    def close(self) -> set[torch.dtype]:
        for handle in self.handles:
            handle.remove()
        return self.seen


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_served_paths_compute_in_the_precision_predict_computes_in(saved, tmp_path, precision):
    """The pipeline, the Auto model and a plain classifier in the pipeline compute in the
    precision asked for (``auto`` resolves as for ``predict``: HYDRA_PRECISION here), and give the
    probabilities ``predict`` gives in it, within that format's rounding."""
    from hydra_ensembles.precision import dtype_of

    dtype = dtype_of(precision)
    folder = saved["calibrated"]
    library = load_any(str(folder))
    calibration = saved_calibration(library)
    predictions = predict(library, [_inputs(folder)], progress=False, precision=precision)
    reference = torch.as_tensor(predictions.member_logits)
    tol = rounding_tolerance(precision, reference, layers=2, fp32=1e-6)
    expected = calibration.records(predictions, list(CLASSES.values()))
    classify = pipeline("hydra-text-classification", model=str(folder), precision=precision)
    seen = _LinearDtypes(classify.model)
    records = classify(TEXTS, batch_size=len(TEXTS))
    assert seen.close() == {dtype}
    assert [r["confidence"] for r in records] == pytest.approx([r["confidence"] for r in expected], abs=tol)
    model = AutoModelForSequenceClassification.from_pretrained(folder, precision=precision)
    seen = _LinearDtypes(model)
    with torch.no_grad():
        logits = model(**_inputs(folder)).logits_per_member.transpose(0, 1).float()
    assert seen.close() == {dtype}
    assert (logits - reference).abs().max().item() <= tol
    plain = tiny_text_classifier_saved(tmp_path)
    classify = pipeline("hydra-text-classification", model=str(plain), precision=precision)
    seen = _LinearDtypes(classify.model)
    records = classify(TEXTS, batch_size=len(TEXTS))
    assert seen.close() == {dtype}
    predictions = predict(load_any(str(plain)), [_inputs(plain)], progress=False, precision=precision)
    expected = per_example(predictions, list(CLASSES.values()))
    assert [r["confidence"] for r in records] == pytest.approx([r["confidence"] for r in expected], abs=tol)


def tiny_text_classifier_saved(folder):
    from .conftest import tiny_text_classifier

    tiny_text_classifier().save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_low_precision_load_keeps_the_calibration_and_stays_within_rounding(saved, precision):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    folder = saved["calibrated"]
    reference = AutoModelForSequenceClassification.from_pretrained(folder)
    low = AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype)
    assert low.calibration == reference.calibration  # read before the cast: not refused
    assert next(low.parameters()).dtype == dtype
    x = _inputs(folder)
    with torch.no_grad():
        ref, got = reference(**x), low(**x)
    assert got.logits.dtype == torch.float32  # aggregation in fp32
    tol = rounding_tolerance(precision, ref.logits_per_member, layers=2, fp32=0.0)
    assert torch.allclose(got.logits_per_member.float(), ref.logits_per_member, atol=tol)
    assert torch.allclose(got.logits.softmax(-1), ref.logits.softmax(-1), atol=tol)
    records = pipeline("hydra-text-classification", model=str(folder), dtype=dtype)(TEXTS)
    assert all("flagged" in r for r in records)


def test_image_pipelines_serve_a_fused_vision_model_in_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_PRECISION", "fp32")  # compared with fp32 computations by hand
    base = tiny_image_classifier()
    hydra = he.fuse(base, list(HEAD_SETS))
    ViTImageProcessor(size={"height": 8, "width": 8}).save_pretrained(tmp_path)
    hydra.save_pretrained(tmp_path)
    model = AutoModelForImageClassification.from_pretrained(tmp_path)
    assert type(model).__name__ == "HydraForImageClassification"
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)) for _ in range(3)]
    records = pipeline("hydra-image-classification", model=str(tmp_path))(images)
    pixels = ViTImageProcessor(size={"height": 8, "width": 8})(images, return_tensors="pt")
    predictions = Predictions(hydra(**pixels).member_logits.detach().numpy())
    expected = per_example(predictions, list(CLASSES.values()))
    assert [r["predicted"] for r in records] == [r["predicted"] for r in expected]
    assert [r["entropy"] for r in records] == pytest.approx([r["entropy"] for r in expected], abs=1e-6)
    standard = pipeline("image-classification", model=str(tmp_path), top_k=1)(images)
    assert [s[0]["label"] for s in standard] == [r["label"] for r in records]


def test_loading_goes_through_the_checked_loader(saved, tmp_path):
    import shutil

    folder = tmp_path / "tampered"
    shutil.copytree(saved["fused"], folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(he.HydraLoadError, match="does not match the checksum"):
        AutoModelForSequenceClassification.from_pretrained(folder)
    with pytest.raises(OSError, match="not a folder saved by hydra-ensembles"):
        HydraForSequenceClassification.from_pretrained(tmp_path / "missing")
    with pytest.raises(TypeError, match="wraps a trained model"):
        HydraForSequenceClassification(AutoConfig.from_pretrained(saved["fused"]))


@pytest.mark.parametrize("kind", ["calibrated", "member", "ensemble"])
def test_save_pretrained_keeps_the_library_format_and_the_calibration(saved, tmp_path, kind):
    model = AutoModelForSequenceClassification.from_pretrained(saved[kind])
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "again")
    assert again.config.saved_format == model.config.saved_format
    assert again.calibration == model.calibration
    x = _inputs(saved[kind])
    with torch.no_grad():
        assert torch.equal(again(**x).logits, model(**x).logits)


def test_a_model_in_memory_wraps_with_its_recorded_calibration(saved):
    library = load_any(str(saved["calibrated"]))
    wrapped = HydraPreTrainedModel.from_ensemble(library)
    assert wrapped.calibration == saved_calibration(library)
    assert wrapped.config.saved_format == "fused"


def test_importing_the_library_is_enough_for_auto_classes_and_pipeline_tasks(saved):
    """In a fresh process: `import hydra_ensembles` registers the config; the first saved model
    read registers the model classes and the pipeline tasks before transformers looks them up."""
    import subprocess
    import sys

    script = f"""
import sys
import hydra_ensembles
assert "hydra_ensembles.serving" not in sys.modules  # transformers' modelling code not imported yet
from transformers import AutoModelForSequenceClassification, pipeline
print(type(AutoModelForSequenceClassification.from_pretrained({str(saved["member"])!r})).__name__)
print(sorted(pipeline("hydra-text-classification", model={str(saved["calibrated"])!r})("a text")[0])[:3])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [
        "HydraForSequenceClassification",
        "['confidence', 'entropy', 'flagged']",
    ]


# the library imported first: also the order of the fresh process above, which serves a Hydra
# model; a plain classifier served in that order is CI's slow run
@pytest.mark.parametrize(
    "order", [pytest.param("library first", marks=pytest.mark.slow), "transformers first"]
)
def test_a_plain_classifier_is_served_in_a_fresh_process(tmp_path, order):
    """The uncertainty tasks exist as soon as transformers' pipelines load, whichever is imported
    first, so a plain Hugging Face classifier (no Hydra config read before) is served too."""
    import subprocess
    import sys

    folder = tmp_path / "plain"
    tiny_text_classifier().save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    imports = ["import hydra_ensembles", "from transformers import pipeline"]
    script = "\n".join(
        [
            *(imports if order == "library first" else imports[::-1]),
            f"""
record = pipeline("hydra-text-classification", model={str(folder)!r})("a text")
print(sorted(record[0] if isinstance(record, list) else record)[:2])
""",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['confidence', 'entropy']"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["auto", "fp32", "bf16", "fp16"])
def test_on_a_gpu_the_served_paths_compute_as_predict_does_there(saved, precision):
    """On a GPU, the pipeline and the Auto model give the probabilities ``predict`` gives there in
    the same precision (``auto``: bf16 where the GPU has it)."""
    folder = saved["calibrated"]
    library = load_any(str(folder)).to("cuda")
    calibration = saved_calibration(load_any(str(folder)))
    inputs = {k: v.to("cuda") for k, v in _inputs(folder).items()}
    predictions = predict(library, [inputs], progress=False, precision=precision)
    expected = calibration.records(predictions, list(CLASSES.values()))
    from hydra_ensembles.precision import resolve_precision

    resolved = resolve_precision(precision, "cuda")
    tol = rounding_tolerance(resolved.name, torch.as_tensor(predictions.member_logits), layers=2, fp32=1e-6)
    classify = pipeline("hydra-text-classification", model=str(folder), device=0, precision=precision)
    seen = _LinearDtypes(classify.model)
    records = classify(TEXTS, batch_size=len(TEXTS))
    assert seen.close() == {resolved.dtype}
    assert [r["confidence"] for r in records] == pytest.approx([r["confidence"] for r in expected], abs=tol)
    model = AutoModelForSequenceClassification.from_pretrained(folder, precision=precision).to("cuda")
    with torch.no_grad():
        logits = model(**inputs).logits_per_member.transpose(0, 1).float().cpu().numpy()
    assert np.abs(logits - predictions.member_logits).max() <= tol
