"""Export a saved classifier (fused Hydra model, member, ensemble) as one ONNX graph.

The graph holds every member and the aggregation: from the preprocessor's tensors (``input_ids``,
``attention_mask``, ... or ``pixel_values``), with dynamic batch and sequence axes, to

- ``logits`` (batch, classes): log of the calibrated ensemble probabilities (the saved temperature
  is part of the graph): ``softmax(logits)`` are the probabilities, ``argmax`` the prediction;
- ``logits_per_member`` (batch, members, classes): the members' logits before calibration;
- where the calibration flags on a feature score (``mds``, ``rmds``, ``mds++``, ``knn``, ``vim``):
  ``ood_score`` (batch,) and ``ood_score_per_member`` (batch, members), that score computed in
  the graph, in float64, from the feature statistics saved with the model (graph constants).

Beside ``model.onnx``, ``calibration.json`` holds the class names, the input and output names and
the saved `Calibration` (temperature, OOD score and flag threshold), so a server with only
onnxruntime computes the flag: ``ood_score > threshold`` for a feature score; for the ``msp``
score, ``1 - max(softmax(logits)) > threshold``.
The preprocessor (tokenizer or image processor) is saved beside them. The export is checked: the
graph is run by onnxruntime on the export's inputs and compared with PyTorch before it is kept.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..calibration.calibration import check_calibration_data
from ..data.registry import saved_length
from ..loading import load_any, saved_preprocessor
from ..saving.files import atomic_dir, atomic_write_json, check_replaceable_dir
from ..saving.formats import write_folder_checksums
from .modeling import HydraPreTrainedModel
from .onnx_graph import OUTPUT_NAMES, SCORE_NAMES, TOLERANCE, GraphSpec, input_limits
from .onnx_ops import GRAPH_CACHE_SHARE, inference_session, runtime_settings
from .quantization import (
    ExportError,
    Quantization,
    check_parity,
    graph_feeds,
    parity,
    quantize_int8,
    refit,
    run_graph,
)

ONNX_NAME = "model.onnx"
SIDECAR_NAME = "calibration.json"

__all__ = [
    "ONNX_NAME",
    "OUTPUT_NAMES",
    "SCORE_NAMES",
    "SIDECAR_NAME",
    "TOLERANCE",
    "ExportError",
    "Quantization",
    "export_onnx",
]


@contextlib.contextmanager
def _as_exported(wrapped: HydraPreTrainedModel) -> Iterator[None]:
    """While exporting: the fused models run the whole batch in one forward (chunks would fix the
    batch size in the graph) and the wrapper computes in fp32; both restored afterwards."""
    hydra = [m for m in wrapped.modules() if hasattr(m, "chunk_rows")]  # models that run members stacked
    chunking = [h.chunk_rows for h in hydra]
    for h in hydra:
        h.chunk_rows = None
    served_in, wrapped.precision = wrapped.precision, "fp32"
    try:
        yield
    finally:
        for h, rows in zip(hydra, chunking, strict=True):
            h.chunk_rows = rows
        wrapped.precision = served_in


def _exported_model(model: Any, preprocessor: Any, out: Path) -> tuple[HydraPreTrainedModel, Any]:
    """The model to export as the served wrapper, in eval mode and float32 (a folder: refused where
    ``out`` is or lies inside it, else loaded, with its saved preprocessor where none is given; in
    memory: refused unless float32), and the preprocessor."""
    if isinstance(model, (str, os.PathLike)):
        source = Path(model)
        if out.resolve().is_relative_to(source.resolve()):  # the folder itself or inside it
            raise ExportError(f"{out} is or lies inside the model folder {source}: choose another output")
        wrapped = _load(source)
        if preprocessor is None:
            preprocessor = saved_preprocessor(source)
        wrapped.float()  # loaded for the export alone
    elif isinstance(model, HydraPreTrainedModel):
        wrapped = model
    else:
        wrapped = HydraPreTrainedModel.from_ensemble(model)
    if any(p.dtype != torch.float32 for p in wrapped.parameters()):
        raise ExportError("the graph is exported in fp32: give a float32 model (model.float())")
    return wrapped.eval(), preprocessor


def _warn_calibration_precision(wrapped: HydraPreTrainedModel, quantize: str | None) -> None:
    """Warn where a float32 graph is served with a calibration fit on bf16 or fp16 outputs."""
    fit_in = wrapped.calibration.precision if wrapped.calibration is not None else ""
    if quantize is None and fit_in not in ("", "fp32"):
        warnings.warn(
            f"the calibration was fit on {fit_in} outputs and the graph computes in fp32: its "
            f"probabilities and scores differ from {fit_in}'s by that format's rounding (a "
            "calibration fit in fp32: build or calibrate with --precision fp32)",
            stacklevel=3,
        )


def _write_export(out: Path, model_bytes: bytes, sidecar: dict, preprocessor: Any) -> Path:
    """The export folder ``out``, written as a whole (atomically): the graph, the preprocessor
    (cut to the calibrated length), the sidecar and the checksums."""
    length = sidecar["max_length"]

    def write(folder: Path) -> None:
        (folder / ONNX_NAME).write_bytes(model_bytes)
        if preprocessor is not None:
            saved = copy.deepcopy(preprocessor)
            if length is not None and hasattr(saved, "model_max_length"):
                saved.model_max_length = length  # truncation=True cuts to what was calibrated
            saved.save_pretrained(folder)
        atomic_write_json(folder / SIDECAR_NAME, sidecar)
        write_folder_checksums(folder)  # the graph, the sidecar, the preprocessor: checked where read

    return atomic_dir(out, write, marker=True)


def export_onnx(
    model: nn.Module | str | os.PathLike,
    out: str | os.PathLike,
    preprocessor: Any = None,
    input_names: Sequence[str] | None = None,
    *,
    opset: int = 20,
    check: bool = True,
    quantize: Quantization | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write ``model.onnx``, ``calibration.json`` and the preprocessor into the folder ``out``
    (replaced as a whole, atomically; new, empty or an earlier export: a folder of other files is
    refused before any work) and return it. ``model``: a folder saved by the library or a float32
    model in memory (its recorded calibration is used). ``preprocessor``: default, the one saved
    with the model; its ``model_input_names`` name the graph's inputs unless ``input_names`` does.
    ``check``: run the graph in onnxruntime on several batch sizes and lengths, `ExportError` where
    an output differs from PyTorch's by more than 1e-4 (the largest difference is recorded).
    ``quantize`` (`Quantization`): int8 weights (`serving.quantization`); the calibration is fit
    again on the graph's own outputs for its validation batches, and ``calibration.json`` records
    what changed (``parity``); refused, nothing written, where its top-1 predictions agree with the
    float32 graph's on fewer than its ``min_agreement`` of the inputs. ``log``: one line per step.
    """
    check_replaceable_dir(out)  # never a folder of the user's own files
    wrapped, preprocessor = _exported_model(model, preprocessor, Path(out))
    if quantize is not None and wrapped.calibration is not None:  # before both graphs are run
        check_calibration_data(quantize.validation, wrapped.calibration.config, wrapped)
    _warn_calibration_precision(wrapped, quantize)
    spec = GraphSpec.of(wrapped, preprocessor, input_names, opset)
    runtime = _runtime_settings(wrapped, dict(zip(spec.names, spec.example(), strict=True)))
    say = log or (lambda line: None)
    quantized = None
    with _as_exported(wrapped):
        say("exporting the graph (torch.export, then the ONNX exporter)")
        graph = spec.graph(wrapped)
        program = spec.export(graph)
        if check:
            say("running the graph in onnxruntime against PyTorch on several input shapes")
        difference = spec.check(program, graph) if check else None
        model_bytes = program.model_proto.SerializeToString()
        if quantize is not None:
            quantized = _quantized(model_bytes, wrapped, spec, quantize, say)
            model_bytes = quantized["model"]
    sidecar = _sidecar(wrapped, spec, difference, graph.output_names)
    sidecar["onnxruntime"] = {**runtime, **input_limits(spec.config, spec.vision)}
    if quantized is not None:
        sidecar["calibration"] = quantized["calibration"]
        sidecar["quantization"] = quantized["report"]
    return _write_export(Path(out), model_bytes, sidecar, preprocessor)


def _quantized(
    model_bytes: bytes,
    wrapped: HydraPreTrainedModel,
    spec: GraphSpec,
    quantize: Quantization,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The int8 graph of the float32 graph ``model_bytes``, its calibration fit again on its own
    outputs for the validation batches and the parity report; the graph is exported again with the
    refit temperature (part of the graph) and quantized again, which must give the same members'
    logits."""
    import numpy as np

    validation, names = list(quantize.validation), list(spec.names)
    labels = np.concatenate([b["labels"].reshape(-1).numpy() for b in validation]).astype(np.int64)
    say(f"quantizing the graph to int8 (activation scales from {len(labels)} validation inputs)")
    feeds = graph_feeds(validation, names)
    int8 = quantize_int8(model_bytes, feeds)
    say(f"running the float32 and int8 graphs on {len(labels)} validation inputs")
    sessions = [inference_session(m) for m in (model_bytes, int8)]  # float32, int8
    reference, outputs = (run_graph(session, validation, names) for session in sessions)
    calibration, refitted = wrapped.calibration, _refitted(wrapped.calibration, outputs, labels, quantize)
    ood = None
    if quantize.ood_validation and calibration is not None:
        ood = tuple(run_graph(s, list(quantize.ood_validation), names) for s in sessions)
    report = parity(reference, outputs, labels, calibration, refitted, ood)
    check_parity(report, quantize.min_agreement)
    if refitted is not None and refitted.temperature != calibration.temperature:
        say("exporting and quantizing again with the refit temperature (part of the graph)")
        int8 = _quantized_again(wrapped, refitted, spec, feeds)
        again = run_graph(inference_session(int8), validation[:1], names)["logits_per_member"]
        if not np.array_equal(again, outputs["logits_per_member"][: len(again)]):
            raise ExportError("quantizing the graph again gave other weights: not written")
    return {
        "model": int8,
        "calibration": None if refitted is None else refitted.to_dict(),
        "report": {
            "weights": "int8, per output channel, of every float32 matrix product; activations int8 at "
            "scales fixed on the validation inputs (onnxruntime's static quantization): a row's "
            "outputs do not depend on its batch",
            "validation": quantize.validation_name,
            "parity": report.to_dict(),
            "calibration_fp32": None if calibration is None else calibration.to_dict(),
        },
    }


def _refitted(calibration, outputs: dict, labels, quantize: Quantization):
    """``calibration`` fit again on the quantized graph's ``outputs`` (None without one)."""
    from ..hashing import batches_digest

    if calibration is None:
        return None
    digest = batches_digest(quantize.validation)
    return refit(calibration, outputs, labels, quantize.validation_name, digest)


def _quantized_again(wrapped, calibration, spec: GraphSpec, feeds) -> bytes:
    """The int8 graph exported again with ``calibration`` in it (its temperature is part of the
    graph); the wrapper's own calibration is restored afterwards."""
    saved, wrapped.calibration = wrapped.calibration, calibration
    try:
        return quantize_int8(spec.export(spec.graph(wrapped)).model_proto.SerializeToString(), feeds)
    finally:
        wrapped.calibration = saved


OUTPUTS = {
    "logits": "(batch, classes): log of the calibrated ensemble probabilities",
    "logits_per_member": "(batch, members, classes): the members' logits before calibration",
    "ood_score": "(batch,): the calibration's feature score (float64), the mean of the members'; "
    "flagged where > calibration.flag.threshold",
    "ood_score_per_member": "(batch, members): each member's feature score (float64)",
}


def _sidecar(
    wrapped: HydraPreTrainedModel, spec: GraphSpec, difference: float | None, outputs: Sequence[str]
) -> dict:
    """``calibration.json``: what a runtime needs beside the graph (classes, inputs, outputs,
    the calibration) and how far the graph was from PyTorch."""
    config = spec.config
    return {
        "format": "hydra-ensembles/onnx",
        "classes": [str(config.id2label[i]) for i in range(int(config.num_labels))],
        "inputs": list(spec.names),
        "outputs": {name: OUTPUTS[name] for name in outputs},
        "members": int(wrapped.ensemble.num_members),
        "calibration": None if wrapped.calibration is None else wrapped.calibration.to_dict(),
        "base_model_type": config.model_type,
        "max_difference_from_pytorch": difference,
        "max_length": None if spec.vision else saved_length(wrapped.ensemble),
    }


def _runtime_settings(wrapped: HydraPreTrainedModel, example: dict[str, torch.Tensor]) -> dict[str, Any]:
    """How onnxruntime should run the graph (`onnx_ops.runtime_settings`): tokens per run sized
    like the fused model's PyTorch chunks on this machine's CPU, to `GRAPH_CACHE_SHARE` of the
    cache, for the widest activation of the member-stacked batch (M members for a fused model,
    one for a member or an ensemble run member after member; None: the whole batch)."""
    from ..adapters import get_adapter
    from ..runtime import inference_chunk_rows

    ensemble = wrapped.ensemble
    if hasattr(ensemble, "chunk_token_rows"):  # members stacked in one pass (a fused model)
        rows, members = ensemble.chunk_token_rows("cpu", GRAPH_CACHE_SHARE), ensemble.num_members
        model, adapter = ensemble.model, ensemble.adapter
    else:
        from transformers import PreTrainedModel

        model = next((m for m in ensemble.modules() if isinstance(m, PreTrainedModel)), None)
        if model is None:
            return runtime_settings(None, None)
        adapter = get_adapter(model)
        rows = inference_chunk_rows(adapter.mlp_width(model), 4, "cpu", GRAPH_CACHE_SHARE)
        members = 1
    tokens = adapter.tokens_per_input(model, example) if "pixel_values" in example else None
    return runtime_settings(None if rows is None else rows // members, tokens)


def _load(folder: Path) -> HydraPreTrainedModel:
    """A folder the library saved, or a Hugging Face classifier folder (``hydra-ens finetune``'s)
    with a trained head."""
    from ..models import untrained_weights
    from ..saving.formats import saved_format

    found = saved_format(folder)
    if found is not None and not found.classifier:
        raise ExportError(f"{folder} is a saved {found.kind} model: ONNX export takes classifiers")
    model = load_any(str(folder))
    if untrained := untrained_weights(model):
        raise ExportError(
            f"{folder} has no trained classifier head ({', '.join(untrained[:2])} would be random)"
        )
    return HydraPreTrainedModel.from_ensemble(model)
