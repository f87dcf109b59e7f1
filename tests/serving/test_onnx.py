"""ONNX export: one graph whose onnxruntime outputs equal PyTorch's, on any batch size and length."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime
import pytest
import torch
from transformers import AutoModelForSequenceClassification, ViTImageProcessor

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.evaluation import Predictions
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.serving.onnx import ExportError, export_onnx

from .conftest import CLASSES, HEAD_SETS, tiny_image_classifier

# one pytest-xdist worker: the exported graphs (conftest's) are built once, not once per worker
pytestmark = pytest.mark.xdist_group("onnx")

TOLERANCE = 1e-4  # fp32, as the export promises


def _text_inputs(batch: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    mask = np.ones((batch, tokens), dtype=np.int64)
    mask[1::2, max(1, tokens // 2) :] = 0  # padding in every other row
    return {
        "input_ids": g.integers(1, 30522, (batch, tokens)),
        "token_type_ids": np.zeros((batch, tokens), dtype=np.int64),
        "attention_mask": mask,
    }


@pytest.mark.parametrize("kind", ["calibrated", "ensemble"])
@pytest.mark.parametrize(("batch", "tokens"), [(1, 1), (2, 7), (6, 19), (13, 40)])
def test_onnxruntime_equals_pytorch_in_fp32_on_any_batch_and_length(
    saved, exported, kind, batch, tokens, monkeypatch
):
    monkeypatch.setenv("HYDRA_PRECISION", "fp32")  # the float32 graph against PyTorch in fp32
    session = onnxruntime.InferenceSession(str(exported[kind] / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["input_ids", "token_type_ids", "attention_mask"]
    inputs = _text_inputs(batch, tokens, seed=batch * 100 + tokens)
    logits, per_member = session.run(["logits", "logits_per_member"], inputs)
    model = AutoModelForSequenceClassification.from_pretrained(saved[kind])
    with torch.no_grad():
        expected = model(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    assert np.abs(logits - expected.logits.numpy()).max() <= TOLERANCE
    assert np.abs(per_member - expected.logits_per_member.numpy()).max() <= TOLERANCE
    assert per_member.shape == (batch, len(HEAD_SETS), len(CLASSES))


def test_the_sidecar_carries_the_calibration_and_the_flag_follows_from_the_outputs(saved, exported):
    sidecar = json.loads((exported["calibrated"] / "calibration.json").read_text())
    calibration = saved_calibration(load_any(str(saved["calibrated"])))
    assert sidecar["calibration"] == calibration.to_dict()
    assert sidecar["classes"] == list(CLASSES.values()) and sidecar["members"] == len(HEAD_SETS)
    assert sidecar["max_difference_from_pytorch"] <= TOLERANCE
    session = onnxruntime.InferenceSession(str(exported["calibrated"] / "model.onnx"))
    inputs = _text_inputs(9, 11, seed=3)
    logits, per_member = session.run(["logits", "logits_per_member"], inputs)
    # the flag from the graph's calibrated logits alone equals the library's records
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    flags = (1 - probs.max(-1)) > sidecar["calibration"]["flag"]["threshold"]
    records = calibration.records(Predictions(per_member.transpose(1, 0, 2)), sidecar["classes"])
    assert flags.tolist() == [r["flagged"] for r in records]
    assert np.allclose(probs.max(-1), [r["confidence"] for r in records], atol=1e-6)
    # the preprocessor is beside the graph
    assert load_tokenizer(str(exported["calibrated"]))("a text")["input_ids"]


def test_the_graph_runs_without_torch_or_hydra_ensembles(exported):
    script = f"""
import sys
sys.modules["torch"] = None
sys.modules["hydra_ensembles"] = None
import json, numpy as np, onnxruntime
folder = {str(exported["calibrated"])!r}
sidecar = json.load(open(folder + "/calibration.json"))
session = onnxruntime.InferenceSession(folder + "/model.onnx")
feed = {{name: np.ones((3, 5), dtype=np.int64) for name in sidecar["inputs"]}}
logits, per_member = session.run(None, feed)
print(logits.shape, per_member.shape)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"(3, {len(CLASSES)}) (3, {len(HEAD_SETS)}, {len(CLASSES)})"


def test_a_fused_vision_model_exports_with_a_dynamic_batch(tmp_path):
    hydra = he.fuse(tiny_image_classifier(), list(HEAD_SETS))
    processor = ViTImageProcessor(size={"height": 8, "width": 8})
    out = export_onnx(hydra, tmp_path / "onnx", preprocessor=processor)
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    for batch in (1, 4, 9):
        pixels = torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(batch))
        logits, per_member = session.run(None, {"pixel_values": pixels.numpy()})
        with torch.no_grad():
            output = hydra(pixel_values=pixels)
        assert np.abs(per_member - output.member_logits.transpose(0, 1).numpy()).max() <= TOLERANCE
        assert np.abs(np.exp(logits) - output.probs.numpy()).max() <= TOLERANCE  # temperature 1
    assert (out / "preprocessor_config.json").is_file()
    settings = json.loads((out / "calibration.json").read_text())["onnxruntime"]
    assert settings["tokens_per_input"] == (8 // 4) ** 2 + 1  # 4-pixel patches and the class token
    from hydra_ensembles.serving.onnx_ops import inference_session, run_session

    pixels = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(5)).numpy()
    runs = {**settings, "tokens_per_run": 2 * settings["tokens_per_input"]}  # two images a run
    chunked = run_session(inference_session(str(out / "model.onnx")), {"pixel_values": pixels}, runs)
    np.testing.assert_allclose(chunked[1], session.run(None, {"pixel_values": pixels})[1], atol=1e-6, rtol=0)


@pytest.mark.same_in_every_precision
def test_export_refuses_what_it_cannot_write_faithfully(saved, tmp_path, monkeypatch):
    """An output inside the model folder is refused before the model is loaded; a model that is
    not float32, before it is exported."""
    from hydra_ensembles.serving import onnx as export_module

    def no_work(*args, **kwargs):
        raise AssertionError("work done before the refusal")

    monkeypatch.setattr(export_module, "_load", no_work)
    monkeypatch.setattr(export_module.GraphSpec, "export", no_work)
    with pytest.raises(ExportError, match="lies inside the model folder"):
        export_onnx(saved["fused"], saved["fused"] / "onnx")
    low = he.fuse(tiny_image_classifier(), list(HEAD_SETS)).to(torch.bfloat16)
    with pytest.raises(ExportError, match="float32"):
        export_onnx(low, tmp_path / "low")
    assert not (tmp_path / "low").exists()


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_a_calibration_fit_in_another_precision_than_the_graph_is_named(saved, tmp_path):
    """The graph computes in fp32: a calibration fit on bf16 outputs is served off its precision,
    and the export says so (one fit in fp32 exports without a word)."""
    import dataclasses
    import warnings

    from hydra_ensembles.serving import HydraPreTrainedModel

    model = HydraPreTrainedModel.from_pretrained(saved["calibrated"])
    assert model.calibration.precision == "fp32"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the calibration was fit")
        export_onnx(model, tmp_path / "fp32", check=False)
    model.calibration = dataclasses.replace(model.calibration, precision="bf16")
    with pytest.warns(UserWarning, match="fit on bf16 outputs and the graph computes in fp32"):
        export_onnx(model, tmp_path / "bf16", check=False)


@pytest.mark.same_in_every_precision
def test_the_cli_exports_and_refuses_a_finished_output(saved, cli_export, tmp_path, capsys):
    folder, said = cli_export
    assert "exported 3 member(s)" in said and "temperature" in said
    side = json.loads((folder / "calibration.json").read_text())
    assert f"outputs {', '.join(side['outputs'])};" in said  # every output the graph has, named
    assert (folder / "model.onnx").is_file()
    with pytest.raises(SystemExit):  # argparse: only onnx is a format
        main(["export", str(saved["calibrated"]), "--out", str(tmp_path / "x"), "--format", "tflite"])
    finished = tmp_path / "onnx"
    shutil.copytree(folder, finished)
    assert main(["export", str(saved["calibrated"]), "--out", str(finished)]) != 0
    assert "--overwrite" in capsys.readouterr().err


def test_fine_tuned_dinov2_members_export_with_a_dynamic_batch(tmp_path):
    """Fine-tuned members keep their own layer scales (per-member modules), whose row count once
    fixed the exported batch size."""
    from ..factories import image_inputs, tiny_dinov2

    base = tiny_dinov2()
    members = [he.prune(base, hs) for hs in (he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2, 3]}))]
    with torch.no_grad():  # as if fine-tuned: every parameter moved, differently per member
        for m, member in enumerate(members):
            for p in member.parameters():
                p.add_(0.01 * (m + 1) * torch.randn_like(p))
    hydra = he.fuse(members, mlp="merge")
    kinds = {entry["kind"] for entry in hydra.layout}
    assert "per_member" in kinds or "grouped_layer_norm" in kinds
    out = export_onnx(hydra, tmp_path / "onnx", input_names=["pixel_values"])
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    for batch in (1, 3, 7):
        x = image_inputs(batch=batch, seed=batch)["pixel_values"]
        _logits, per_member = session.run(None, {"pixel_values": x.numpy()})
        with torch.no_grad():
            expected = hydra(pixel_values=x).member_logits.transpose(0, 1)
        assert np.abs(per_member - expected.numpy()).max() <= TOLERANCE


# the composite config both keep their image size in stays with CLIP; SigLIP's graph (its
# attention-pooling head) is CI's slow run
@pytest.mark.parametrize("family", ["clip", pytest.param("siglip", marks=pytest.mark.slow)])
def test_vision_towers_with_a_composite_config_export(family, tmp_path):
    """CLIP's and SigLIP's classifiers keep the image size in ``vision_config``."""
    from tests.factories import FAMILIES

    factory, _ = FAMILIES[family]
    hydra = he.fuse(factory(), [he.HeadSet({0: [0, 1], 1: [2, 3]}), he.HeadSet({0: [1, 2, 3], 1: [0]})])
    out = export_onnx(hydra, tmp_path / "onnx")
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    for batch in (1, 5):
        pixels = torch.randn(batch, 1, 8, 8, generator=torch.Generator().manual_seed(batch))
        _, per_member = session.run(None, {"pixel_values": pixels.numpy()})
        with torch.no_grad():
            expected = hydra(pixel_values=pixels).member_logits.transpose(0, 1).numpy()
        assert np.abs(per_member - expected).max() <= TOLERANCE


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_fused_decoder_llm_exports_with_dynamic_batch_and_length(family, tmp_path):
    """Grouped-query attention through its key/value index, rotary embeddings, the causal mask and
    the last-token pooling, in one graph: onnxruntime equals PyTorch on right-padded inputs."""
    from tests.factories import PAD, decoder_inputs, tiny_decoder

    model = tiny_decoder(family, layers=2, heads=4, head_dim=4, init_range=0.3)
    hydra = he.fuse(model, [he.HeadSet({0: [0, 1, 3]}), he.HeadSet({0: [2], 1: []}), he.HeadSet({1: [1, 2]})])
    out = export_onnx(hydra, tmp_path / "onnx", input_names=["input_ids", "attention_mask"])
    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    for batch, tokens in ((1, 3), (4, 9), (7, 12)):
        x = decoder_inputs(batch, tokens, seed=batch)
        assert (x["input_ids"] == PAD).any() or batch == 1
        _, per_member = session.run(None, {k: v.numpy() for k, v in x.items()})
        with torch.no_grad():
            expected = hydra(**x).member_logits.transpose(0, 1).numpy()
        assert np.abs(per_member - expected).max() <= TOLERANCE


def test_rows_pytorch_refuses_give_nan_in_the_graph(exported):
    """A token id outside the vocabulary (PyTorch raises), a token type outside the model's types
    or an attention mask of zeros only (nothing to read) gives NaN in every output of that row, in
    the raw session too; the other rows are unaffected."""
    session = onnxruntime.InferenceSession(str(exported["calibrated"] / "model.onnx"))
    inputs = _text_inputs(5, 6, seed=7)
    clean = session.run(["logits", "logits_per_member"], inputs)
    inputs["input_ids"][0, 2] = -3
    inputs["input_ids"][1, 0] = 30522  # MiniLM's vocabulary has 30522 ids: one past the last
    inputs["attention_mask"][2] = 0
    inputs["token_type_ids"][3, 1] = 2  # BERT's two token types: one past the last
    logits, per_member = session.run(["logits", "logits_per_member"], inputs)
    assert np.isnan(logits[:4]).all() and np.isnan(per_member[:4]).all()
    assert np.array_equal(logits[4:], clean[0][4:]) and np.array_equal(per_member[4:], clean[1][4:])


def test_the_serving_pages_onnx_example_runs_as_written(saved, exported, tmp_path, monkeypatch):
    """docs/serving.md's onnxruntime snippet runs as written beside an export (one that flags on
    MSP; the feature-score branch reads `ood_score`, checked in test_feature_scores) and gives the
    library's flags."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "InferenceSession" in b)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "onnx").symlink_to(exported["calibrated"])
    namespace: dict = {}
    exec(compile(block, "docs/serving.md", "exec"), namespace)
    calibration = saved_calibration(load_any(str(saved["calibrated"])))
    records = calibration.records(
        Predictions(namespace["outputs"]["logits_per_member"].transpose(1, 0, 2)),
        namespace["side"]["classes"],
    )
    assert namespace["flagged"].tolist() == [r["flagged"] for r in records]
    assert namespace["usable"].all()
    classes = namespace["side"]["classes"]
    sets = [[c for c, member in zip(classes, row, strict=True) if member] for row in namespace["in_set"]]
    assert sets == [r["prediction_set"] for r in records]


def _graph(folder):
    import onnx

    return onnx.load(str(folder / "model.onnx"))


def test_the_fused_attention_is_onnxruntimes_attention_operator_one_per_member_and_layer(exported):
    """Each member's attention of each layer is one com.microsoft Attention node writing one
    output (no key/value cache), and every matrix product reads a weight of its own (what the int8
    quantizer rewrites)."""
    graph = _graph(exported["calibrated"]).graph
    attention = [n for n in graph.node if n.op_type == "Attention"]
    layers = 2
    assert len(attention) == layers * len(HEAD_SETS)  # a member keeping no head: zero weights
    assert {n.domain for n in attention} == {"com.microsoft"}
    assert all(len(n.output) == 1 for n in attention)
    weights = {i.name for i in graph.initializer}
    assert all(n.input[1] in weights for n in graph.node if n.op_type in ("Attention", "MatMul", "Gemm"))


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_a_score_bias_family_keeps_the_decomposed_attention_and_exports_exactly(tmp_path):
    from tests.factories import tiny_mpnet

    model = he.fuse(tiny_mpnet(), [he.HeadSet({0: [0, 1], 1: [2]}), he.HeadSet({0: [3], 1: [0]})])
    out = export_onnx(model.eval(), tmp_path / "mpnet", input_names=["input_ids", "attention_mask"])
    assert not [n for n in _graph(out).graph.node if n.op_type == "Attention"]
    sidecar = json.loads((out / "calibration.json").read_text())
    assert sidecar["max_difference_from_pytorch"] <= TOLERANCE


def test_the_sidecar_says_how_onnxruntime_runs_the_graph(saved, exported):
    from hydra_ensembles.serving.modeling import HydraPreTrainedModel
    from hydra_ensembles.serving.onnx import _runtime_settings

    settings = json.loads((exported["calibrated"] / "calibration.json").read_text())["onnxruntime"]
    fused = HydraPreTrainedModel.from_pretrained(saved["calibrated"])
    example = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    assert settings == {
        "disabled_optimizers": ["SkipLayerNormFusion"],
        "tokens_per_run": _runtime_settings(fused, example)["tokens_per_run"],  # sized below
        "tokens_per_input": None,
        "max_positions": 512,  # the tiny BERT's positions and token types: what a feed may hold
        "type_vocab_size": 2,
    }
    assert settings["tokens_per_run"] > 0


def test_tokens_per_run_are_a_share_of_the_measured_cache_per_member(saved, monkeypatch):
    from hydra_ensembles import runtime
    from hydra_ensembles.serving.modeling import HydraPreTrainedModel
    from hydra_ensembles.serving.onnx import _runtime_settings
    from hydra_ensembles.serving.onnx_ops import GRAPH_CACHE_SHARE

    monkeypatch.delenv("HYDRA_CHUNK_ROWS", raising=False)
    monkeypatch.setattr(runtime, "chunk_cache_bytes", lambda: 12 << 20)
    rows = int(GRAPH_CACHE_SHARE * (12 << 20) / (48 * 4))  # the tiny BERT's MLP width, float32
    example = {"input_ids": torch.ones(2, 8, dtype=torch.long)}
    fused = HydraPreTrainedModel.from_pretrained(saved["calibrated"])
    assert _runtime_settings(fused, example)["tokens_per_run"] == rows // len(HEAD_SETS)
    member = HydraPreTrainedModel.from_pretrained(saved["member"])  # one member: the whole share
    assert _runtime_settings(member, example)["tokens_per_run"] == rows
    monkeypatch.setenv("HYDRA_CHUNK_ROWS", "60")  # the fused model's chunks: 60 member-stacked rows
    assert _runtime_settings(fused, example)["tokens_per_run"] == 60 // len(HEAD_SETS)
    monkeypatch.setenv("HYDRA_CHUNK_ROWS", "0")  # no chunks: the whole batch in one run
    assert _runtime_settings(fused, example)["tokens_per_run"] is None


def test_runs_in_chunks_give_the_whole_batchs_outputs_in_balanced_runs(exported):
    from hydra_ensembles.serving.onnx_ops import inference_session, run_session

    session = inference_session(str(exported["calibrated"] / "model.onnx"))
    inputs = _text_inputs(9, 6, seed=3)
    whole = session.run(None, inputs)
    sizes = []

    class Counting:
        def get_inputs(self):
            return session.get_inputs()

        def run(self, outputs, feed):
            sizes.append(len(feed["input_ids"]))
            return session.run(outputs, feed)

    chunked = run_session(Counting(), inputs, {"tokens_per_run": 24, "tokens_per_input": None})
    assert sizes == [3, 3, 3]  # 4 inputs of 6 tokens fit a run: 9 inputs in three runs of 3, not 4 + 4 + 1
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    sizes.clear()
    run_session(Counting(), inputs, {"tokens_per_run": 2, "tokens_per_input": None})
    assert sizes == [1] * 9  # at least one input a run


@pytest.mark.parametrize("edit", ["threshold", "classes", "graph"])
def test_an_export_changed_after_export_is_refused_where_it_is_read(exported, tmp_path, capsys, edit):
    """An export folder is checksummed like every folder the library writes: a sidecar whose
    threshold or class names were edited, or a graph swapped for another, is refused by
    ``inference_session`` (the documented serving code), ``hydra-ens info`` and the serving
    page's snippet, instead of serving the edit."""
    import json
    import shutil

    from hydra_ensembles.errors import InputError
    from hydra_ensembles.serving.onnx_ops import inference_session

    folder = tmp_path / "edited"
    shutil.copytree(exported["calibrated"], folder)
    side = json.loads((folder / "calibration.json").read_text())
    if edit == "threshold":
        side["calibration"]["flag"]["threshold"] = -1.0  # every input would be flagged
    elif edit == "classes":
        side["classes"] = side["classes"][::-1]
    if edit == "graph":
        shutil.copy(exported["ensemble"] / "model.onnx", folder / "model.onnx")
    else:
        (folder / "calibration.json").write_text(json.dumps(side))
    changed = "model.onnx" if edit == "graph" else "calibration.json"
    with pytest.raises(InputError, match=f"{changed} was modified after saving"):
        inference_session(str(folder / "model.onnx"))
    capsys.readouterr()
    assert main(["info", str(folder)]) == 2
    assert f"{changed} was modified after saving" in capsys.readouterr().err
    inference_session(str(exported["calibrated"] / "model.onnx"))  # the export as written serves


def test_the_serving_helper_refuses_a_feed_the_graph_cannot_read_naming_the_models_limits(exported):
    """What would fail the whole batch inside a node of the graph is refused in one line by
    `run_session`, with the model's limits recorded at export; rows it can read but not answer
    (an id outside the vocabulary, a mask of zeros only) are NaN rows, as before."""
    from hydra_ensembles.errors import InputError
    from hydra_ensembles.serving.onnx_ops import inference_session, run_session

    folder = exported["calibrated"]
    side = json.loads((folder / "calibration.json").read_text())["onnxruntime"]
    session = inference_session(str(folder / "model.onnx"))
    good = _text_inputs(3, 6, seed=1)
    cases = [
        ({**good, "token_type_ids": good["token_type_ids"] + 5}, "the model has 2 token types"),
        (_text_inputs(2, 600, seed=1), "more than the model's 512 positions"),
        (_text_inputs(2, 0, seed=1), "empty sequence"),
        ({**good, "attention_mask": good["attention_mask"][:2]}, "shapes disagree"),
        ({k: v for k, v in good.items() if k != "token_type_ids"}, "missing ['token_type_ids']"),
        ({**good, "input_ids": good["input_ids"].astype(np.float32)}, "input_ids must hold integers"),
        ({**good, "input_ids": good["input_ids"][0]}, "input_ids must have 2 dimensions"),
    ]
    for feed, fragment in cases:
        with pytest.raises(InputError, match=re.escape(fragment)) as raised:
            run_session(session, feed, side)
        assert "\n" not in str(raised.value)
    narrow = {k: v.astype(np.int32) for k, v in good.items()}  # any integer width is taken
    np.testing.assert_array_equal(run_session(session, narrow, side)[0], session.run(None, good)[0])
