"""Quantized ONNX export: an int8 graph whose calibration is fit again on its own outputs, with a
parity report; refused where its predictions drift from the float32 graph's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import onnxruntime
import pytest
from scipy.special import log_softmax, logsumexp

from hydra_cli import main
from hydra_ensembles import metrics as M
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.calibration.calibration import Calibration
from hydra_ensembles.calibration.provenance import DataRecord, Provenance
from hydra_ensembles.evaluation import Predictions
from hydra_ensembles.hashing import batches_digest
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.serving import onnx as export_module
from hydra_ensembles.serving.onnx import ExportError, Quantization, export_onnx
from hydra_ensembles.serving.onnx_ops import inference_session
from hydra_ensembles.serving.quantization import flag_scores

from .conftest import validation

# one pytest-xdist worker, with the ONNX module: the exported graphs (this module's and conftest's)
# are built once, not once per worker
pytestmark = pytest.mark.xdist_group("onnx")


def _outputs(folder, batch) -> dict[str, np.ndarray]:
    """The graph's outputs in a session with the settings its calibration was fit under (int8
    outputs move with onnxruntime's fusions: a near tie can change class)."""
    session = inference_session(str(folder / "model.onnx"))
    feed = {name: batch[name].numpy() for name in ("input_ids", "token_type_ids", "attention_mask")}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True))


@pytest.fixture(scope="module")
def quantized(saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    val = validation(load_tokenizer())
    setting = Quantization(val, ood_validation=_ood(), validation_name="val", min_agreement=0.5)
    return export_onnx(saved["calibrated"], root / "q", quantize=setting), val


def _ood() -> list[dict]:
    """OOD validation batches for the text models of conftest."""
    texts = [f"flour sugar oven {i}" for i in range(12)]
    return [dict(load_tokenizer()(texts, padding=True, return_tensors="pt"))]


def test_the_int8_graph_is_calibrated_on_its_own_outputs(saved, quantized):
    """The sidecar's calibration is Calibration.fit, with the saved settings, on the int8 graph's
    members' logits (recomputed here), and the graph's `logits` carry that refit temperature."""
    folder, val = quantized
    graph = onnx.load(folder / "model.onnx")
    ops = {n.op_type for n in graph.graph.node}  # int8 products at fixed scales, none set at run time
    assert {"QLinearMatMul", "QuantizeLinear"} <= ops and "DynamicQuantizeLinear" not in ops
    side = json.loads((folder / "calibration.json").read_text())
    outputs = _outputs(folder, val[0])
    labels = val[0]["labels"].numpy()
    original = saved_calibration(load_any(str(saved["calibrated"])))
    expected = Calibration.fit(
        Predictions(outputs["logits_per_member"].transpose(1, 0, 2), labels),
        original.config,
        provenance=Provenance(DataRecord("val", batches_digest(val))),
        precision="int8",
        model_sha256=original.model_sha256,
    )
    assert Calibration.from_dict(side["calibration"]) == expected
    assert Calibration.from_dict(side["quantization"]["calibration_fp32"]) == original
    per_member = outputs["logits_per_member"].astype(np.float64) / expected.temperature
    members = per_member.shape[1]
    mixture = logsumexp(log_softmax(per_member, axis=-1), axis=1) - np.log(members)
    np.testing.assert_allclose(outputs["logits"], mixture, atol=1e-5)


@pytest.mark.same_in_every_precision
def test_the_parity_report_measures_both_graphs_on_the_validation_data(saved, quantized, exported):
    folder, val = quantized
    parity = json.loads((folder / "calibration.json").read_text())["quantization"]["parity"]
    reference = _outputs(exported["calibrated"], val[0])  # the float32 graph
    int8 = _outputs(folder, val[0])
    labels = val[0]["labels"].numpy()
    original = saved_calibration(load_any(str(saved["calibrated"])))
    p_ref = Predictions(reference["logits_per_member"].transpose(1, 0, 2)).probs(original.temperature)
    p_int8 = Predictions(int8["logits_per_member"].transpose(1, 0, 2)).probs(original.temperature)
    assert parity["examples"] == len(labels)
    assert parity["agreement"] == pytest.approx(float(np.mean(p_ref.argmax(-1) == p_int8.argmax(-1))))
    assert parity["nll_fp32"] == pytest.approx(M.nll(p_ref, labels), rel=1e-6)
    assert parity["ece_quantized"] == pytest.approx(M.ece(p_int8, labels), rel=1e-6)
    msp = 1 - p_ref.max(-1)
    assert parity["flag_rate_fp32"] == pytest.approx(float(np.mean(msp > original.flag.threshold)))
    # the held-out rate: refit on one half of the validation inputs, measured on the other
    from hydra_ensembles.serving.quantization import _held_out_flag_rate

    refitted = Calibration.from_dict(json.loads((folder / "calibration.json").read_text())["calibration"])
    expected = _held_out_flag_rate(refitted, int8, labels)
    assert parity["flag_rate_held_out"] == pytest.approx(expected["flag_rate_held_out"])
    assert 0 <= parity["flag_rate_held_out"] <= 1
    # and how often the served graphs' flags agree there: the int8 flag refit on one half against
    # the float32 graph's own flag (msp at its calibration), on the other half
    from hydra_ensembles.serving.quantization import refit

    halves = (slice(0, None, 2), slice(1, None, 2))
    agree = []
    for fit_rows, test_rows in (halves, halves[::-1]):
        half = refit(refitted, {k: v[fit_rows] for k, v in int8.items()}, labels[fit_rows], "", "")
        p_half = Predictions(int8["logits_per_member"][test_rows].transpose(1, 0, 2)).probs(half.temperature)
        agree.append(
            np.mean((1 - p_half.max(-1) > half.flag.threshold) == (msp[test_rows] > original.flag.threshold))
        )
    assert parity["flag_agreement_held_out"] == pytest.approx(float(np.mean(agree)))


def test_a_flag_whose_held_out_rate_drifts_is_measured_as_drifted():
    """Scores that move unevenly (here: every odd-numbered validation input far above the even
    ones) give a held-out rate above what a calibration draw of that size stays under, which is
    what the export warns on; scores alike in both halves stay under it."""
    from hydra_ensembles.serving.quantization import _held_out_flag_rate

    rng = np.random.default_rng(0)
    n = 200
    logits = rng.normal(size=(n, 2, 3)).astype(np.float32)
    labels = logits.mean(1).argmax(-1)
    alike = {"logits_per_member": logits}
    calibration = Calibration.fit(
        Predictions(logits.transpose(1, 0, 2), labels), score="max_logit", keep=0.95
    )
    report = _held_out_flag_rate(calibration, alike, labels)
    assert report["flag_rate_held_out"] <= report["flag_rate_ceiling"]
    drifted = logits.copy()
    drifted[1::2] -= 50.0  # max_logit scores -max logit: the odd half scores far higher
    report = _held_out_flag_rate(calibration, {"logits_per_member": drifted}, labels)
    assert report["flag_rate_held_out"] > report["flag_rate_ceiling"]


@pytest.mark.same_in_every_precision
def test_the_parity_report_measures_the_flag_scores_auroc_on_ood_validation_data(saved, quantized, exported):
    """Both graphs run on the OOD validation batches; the AUROC of each graph's flag score (ID
    validation vs OOD) at its own calibration is reported."""
    folder, val = quantized
    ood = _ood()
    side = json.loads((folder / "calibration.json").read_text())
    parity = side["quantization"]["parity"]
    original = saved_calibration(load_any(str(saved["calibrated"])))
    refitted = Calibration.from_dict(side["calibration"])
    fp32 = exported["calibrated"]
    reference, reference_ood = _outputs(fp32, val[0]), _outputs(fp32, ood[0])
    int8, int8_ood = _outputs(folder, val[0]), _outputs(folder, ood[0])
    expected_fp32 = M.auroc(flag_scores(reference, original), flag_scores(reference_ood, original))
    expected_int8 = M.auroc(flag_scores(int8, refitted), flag_scores(int8_ood, refitted))
    assert parity["ood_auroc_fp32"] == pytest.approx(expected_fp32)
    assert parity["ood_auroc_quantized"] == pytest.approx(expected_int8)


def test_the_int8_graph_keeps_the_nan_contract_for_rows_pytorch_refuses(quantized):
    folder, val = quantized
    batch = {k: v.clone() for k, v in val[0].items()}
    batch["attention_mask"][0] = 0
    batch["input_ids"][1, 0] = 30522  # past the vocabulary
    outputs = _outputs(folder, batch)
    assert np.isnan(outputs["logits"][:2]).all() and np.isfinite(outputs["logits"][2:]).all()


@pytest.mark.same_in_every_precision
def test_an_int8_graph_that_changes_predictions_is_refused_and_nothing_written(saved, tmp_path, monkeypatch):
    val = validation(load_tokenizer())
    real = export_module.parity

    def drifted(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), agreement=0.9)

    monkeypatch.setattr(export_module, "parity", drifted)
    with pytest.raises(ExportError, match=r"another class than the float32 graph for 10\.0%"):
        export_onnx(saved["calibrated"], tmp_path / "q", quantize=Quantization(val, min_agreement=0.95))
    assert not (tmp_path / "q").exists()
    with pytest.raises(ExportError, match="labelled ID validation"):
        Quantization([])
    with pytest.raises(ExportError, match="labelled ID validation"):
        Quantization(iter([]))  # an empty generator is no data either
    held = Quantization(iter(val), ood_validation=iter(val))  # read many times: held, not consumed
    assert len(held.validation) == len(held.ood_validation) == len(val)
    with pytest.raises(ExportError, match="unknown quantization"):
        Quantization(val, kind="int4")


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_the_cli_quantizes_with_validation_data_and_says_what_changed(saved, tmp_path, capsys):
    pairs = (("goal", "sport"), ("goal", "sport"), ("bank", "money"), ("bank", "money"))
    rows = [f"{word} {i}{k},{label}" for i in range(10) for k, (word, label) in enumerate(pairs)]
    (tmp_path / "val.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    argv = ["export", str(saved["calibrated"]), "--format", "onnx", "--out", str(tmp_path / "q")]
    assert main([*argv, "--quantize", "int8"]) == 2
    assert "give --val-data" in capsys.readouterr().err and not (tmp_path / "q").exists()
    assert main([*argv, "--val-data", str(tmp_path / "val.csv")]) == 2
    assert "give --quantize int8" in capsys.readouterr().err
    (tmp_path / "one.csv").write_text("text,label\ngoal 1,sport\n")  # refused before any graph runs
    assert main([*argv, "--quantize", "int8", "--val-data", str(tmp_path / "one.csv")]) == 2
    assert "at least 2 labelled validation inputs" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    assert (
        main([*argv, "--quantize", "int8", "--val-data", str(tmp_path / "val.csv"), "--min-agreement", "0.5"])
        == 0
    )
    assert "int8 graph on 40 validation inputs: top-1 agreement with float32" in capsys.readouterr().out
    side = json.loads((tmp_path / "q" / "calibration.json").read_text())
    assert (
        side["quantization"]["validation"].endswith("val.csv") and side["calibration"]["precision"] == "int8"
    )


def test_onnxruntime_releases_whose_quantizer_mixes_up_gemm_weights_are_refused(monkeypatch):
    """Before 1.32, onnxruntime's quantizer renamed the Gemm weights it transposes without looking
    at the names already taken (it failed on these graphs): refused with one line naming both
    releases, before anything runs."""
    from hydra_ensembles.serving.quantization import quantize_int8

    monkeypatch.setattr(onnxruntime, "__version__", "1.30.0")
    with pytest.raises(ValueError, match=r"needs onnxruntime >= 1\.32 \(installed: 1\.30\.0\)"):
        quantize_int8(b"not read", [])


def test_an_int8_flag_that_loses_its_separation_is_refused_and_one_unmeasured_is_warned_of(capsys):
    """A flag whose AUROC on --ood-data falls by more than MAX_AUROC_DROP under int8 is refused,
    nothing written (measured: mds_layers, 0.99 -> 0.81 on BBC News); without OOD validation data
    the export says that nothing measured it, and what int8 did on the benchmark."""
    from hydra_cli.export import _print_parity
    from hydra_ensembles.serving.onnx import ExportError
    from hydra_ensembles.serving.quantization import MAX_AUROC_DROP, Parity
    from hydra_ensembles.serving.quantization import check_parity as _check_parity

    parity = {"examples": 40, "agreement": 1.0, "nll_fp32": 0.1, "nll_quantized": 0.1, "nll_refit": 0.1}
    parity |= {"ece_fp32": 0.01, "ece_quantized": 0.01, "ece_refit": 0.01, "flag_rate_fp32": 0.05}
    parity |= {"flag_rate_quantized": 0.05, "flag_rate_refit": 0.05, "max_probability_change": 0.01}
    kept = parity | {"ood_auroc_fp32": 0.99, "ood_auroc_quantized": 0.99 - MAX_AUROC_DROP / 2}
    _check_parity(Parity(**kept), 0.99)
    _print_parity(kept, "mds_layers")
    assert "warning" not in capsys.readouterr().err
    lost = parity | {"ood_auroc_fp32": 0.9934, "ood_auroc_quantized": 0.8074}
    with pytest.raises(
        ExportError, match=r"AUROC 0\.8074 against the float32 graph's 0\.9934 .* not written"
    ):
        _check_parity(Parity(**lost), 0.99)
    _print_parity(parity, "mds_layers")
    assert "without --ood-data nothing measured what int8 did to the flag" in capsys.readouterr().err


def test_an_int8_record_does_not_depend_on_the_batch_it_is_scored_in(quantized):
    """The activations' scales are fixed when the graph is made (static quantization on the
    validation inputs): a row scored alone and inside a batch of others gets the same logits and
    OOD score, to float rounding (dynamic quantization took each scale from the whole batch)."""
    folder, _ = quantized
    texts = [f"goal bank flour {i} " * (1 + i % 3) for i in range(10)]
    encode = load_tokenizer()
    batch = dict(encode(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt"))
    together = _outputs(folder, batch)
    for i in range(len(texts)):
        alone = _outputs(folder, {name: value[i : i + 1] for name, value in batch.items()})
        for name in set(alone) & {"logits_per_member", "ood_score", "logits"}:
            np.testing.assert_allclose(alone[name][0], together[name][i], rtol=1e-5, atol=1e-5)
