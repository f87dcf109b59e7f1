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
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.registry import saved_length
from ..evaluation.calibration import check_calibration_data
from ..layers.attention import member_attention_ops
from ..loading import load_any, saved_preprocessor
from ..models import VISION_MODEL_TYPES
from ..ood.registry import feature_scores
from ..saving.files import atomic_dir, atomic_write_json, check_replaceable_dir
from ..saving.formats import write_folder_checksums
from .modeling import HydraPreTrainedModel
from .onnx_ops import (
    GRAPH_CACHE_SHARE,
    drop_unused_outputs,
    fold_weights,
    inference_session,
    runtime_settings,
    translation_table,
)
from .quantization import (
    MIN_AGREEMENT,
    QUANTIZATIONS,
    ExportError,
    check_parity,
    graph_feeds,
    parity,
    quantize_int8,
    refit,
    run_graph,
)

ONNX_NAME = "model.onnx"
SIDECAR_NAME = "calibration.json"
OUTPUT_NAMES = ("logits", "logits_per_member")
SCORE_NAMES = ("ood_score", "ood_score_per_member")
TOLERANCE = 1e-4
"""The largest difference (fp32) accepted between onnxruntime's outputs and PyTorch's."""

__all__ = ["ONNX_NAME", "OUTPUT_NAMES", "SIDECAR_NAME", "ExportError", "export_onnx"]


class _Graph(nn.Module):
    """The wrapped model's forward with named tensor inputs and a tuple of outputs. A row that
    PyTorch would refuse or that holds nothing to read (a token id outside the vocabulary, a token
    type outside the model's types, an attention mask of zeros only) gives NaN in every output of
    that row, never a number, and the batch's other rows their own outputs."""

    def __init__(
        self, model: HydraPreTrainedModel, input_names: Sequence[str], vocab: int | None, types: int | None
    ) -> None:
        super().__init__()
        self.model, self.input_names, self.vocab, self.types = model, tuple(input_names), vocab, types
        calibration = model.calibration
        self.scored = calibration is not None and calibration.score in feature_scores()
        self.output_names = OUTPUT_NAMES + (SCORE_NAMES if self.scored else ())

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(self.input_names, tensors, strict=True))
        valid = None
        if "input_ids" in inputs and self.vocab:
            ids = inputs["input_ids"]
            valid = ((ids >= 0) & (ids < self.vocab)).all(-1)
            inputs["input_ids"] = ids.clamp(0, self.vocab - 1)  # what is read of a refused row is moot
        if "token_type_ids" in inputs and self.types:
            kinds = inputs["token_type_ids"]
            typed = ((kinds >= 0) & (kinds < self.types)).all(-1)
            valid = typed if valid is None else valid & typed
            inputs["token_type_ids"] = kinds.clamp(0, self.types - 1)
        if "attention_mask" in inputs:
            attended = inputs["attention_mask"].sum(-1) > 0
            valid = attended if valid is None else valid & attended
        out = self.model(**inputs)
        outputs = (out.logits, out.logits_per_member)
        if self.scored:
            outputs += (out.ood_score, out.ood_score_per_member)
        if valid is None:
            return outputs
        return tuple(_refused_as_nan(x, valid) for x in outputs)


def _refused_as_nan(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with the rows that are not ``valid`` (batch first) set to NaN."""
    shape = (-1,) + (1,) * (x.dim() - 1)
    return torch.where(valid.reshape(shape), x, torch.full_like(x, float("nan")))


def _check_quantization(quantize: str | None, validation: Any) -> None:
    """ExportError for an unknown quantization, or one without the validation data it is
    calibrated again on."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ExportError(f"unknown quantization {quantize!r}; choose from {QUANTIZATIONS}")
    if quantize is not None and not validation:
        raise ExportError(
            "a quantized graph is calibrated again on its own outputs: give labelled ID validation "
            "batches (--val-data)"
        )


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


def _exported_model(model: Any, preprocessor: Any) -> tuple[HydraPreTrainedModel, Any, Path | None]:
    """The model to export as the served wrapper, in eval mode and float32 (a folder: loaded, with
    its saved preprocessor where none is given; in memory: refused unless float32), the
    preprocessor, and the folder it came from (None in memory)."""
    source = None
    if isinstance(model, (str, os.PathLike)):
        source = Path(model)
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
    return wrapped.eval(), preprocessor, source


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


def _write_export(
    out: Path, source: Path | None, model_bytes: bytes, sidecar: dict, preprocessor: Any
) -> Path:
    """The export folder ``out``, written as a whole (atomically): the graph, the preprocessor
    (cut to the calibrated length), the sidecar and the checksums; never inside ``source``."""
    if source is not None and (
        out.resolve() == source.resolve() or source.resolve() in out.resolve().parents
    ):
        raise ExportError(f"{out} is or lies inside the model folder {source}: choose another output")
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
    opset: int = 20,
    check: bool = True,
    quantize: str | None = None,
    validation: Sequence[dict[str, Any]] | None = None,
    ood_validation: Sequence[dict[str, Any]] | None = None,
    validation_name: str = "",
    min_agreement: float = MIN_AGREEMENT,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write ``model.onnx``, ``calibration.json`` and the preprocessor into the folder ``out``
    (replaced as a whole, atomically; new, empty or an earlier export: a folder of other files is
    refused before any work) and return it. ``model``: a folder saved by the library or a float32
    model in memory (its recorded calibration is used). ``preprocessor``: default, the one saved
    with the model; its ``model_input_names`` name the graph's inputs unless ``input_names`` does.
    ``check``: run the graph in onnxruntime on several batch sizes and lengths, `ExportError` where
    an output differs from PyTorch's by more than 1e-4 (the largest difference is recorded).
    ``quantize="int8"``: int8 weights (`serving.quantization`); the calibration is fit again on the
    graph's own outputs for the labelled ID batches ``validation`` (named ``validation_name``), and
    ``calibration.json`` records what changed (``parity``; with ``ood_validation``, the flag
    score's AUROC too). Refused, nothing written, where its top-1 predictions agree with the
    float32 graph's on fewer than ``min_agreement`` of the inputs. ``log``: one line per step.
    """
    _check_quantization(quantize, validation)
    check_replaceable_dir(out)  # never a folder of the user's own files
    wrapped, preprocessor, source = _exported_model(model, preprocessor)
    if quantize is not None and wrapped.calibration is not None:  # before both graphs are run
        check_calibration_data(validation, wrapped.calibration.config, wrapped)
    _warn_calibration_precision(wrapped, quantize)
    config = _base_config(wrapped)
    vision = config.model_type in VISION_MODEL_TYPES
    names = list(input_names or _input_names(preprocessor, vision))
    example = _example_inputs(config, names, vision, batch=2, tokens=8)
    runtime = _runtime_settings(wrapped, dict(zip(names, example, strict=True)))
    say = log or (lambda line: None)
    quantized = None
    with _as_exported(wrapped):
        say("exporting the graph (torch.export, then the ONNX exporter)")
        graph = _Graph(wrapped, names, *_vocabulary(config, vision)).eval()
        program = _export(graph, example, names, vision, opset)
        if check:
            say("running the graph in onnxruntime against PyTorch on several input shapes")
        difference = _check(program, graph, config, names, vision) if check else None
        model_bytes = program.model_proto.SerializeToString()
        if quantize is not None:
            quantized = _quantized(
                model_bytes, wrapped, config, names, vision, opset, example,
                validation, ood_validation, validation_name, min_agreement, say,
            )  # fmt: skip
            model_bytes = quantized["model"]
    sidecar = _sidecar(wrapped, config, names, difference, graph.output_names, vision)
    sidecar["onnxruntime"] = {**runtime, **_input_limits(config, vision)}
    if quantized is not None:
        sidecar["calibration"] = quantized["calibration"]
        sidecar["quantization"] = quantized["report"]
    return _write_export(Path(out), source, model_bytes, sidecar, preprocessor)


def _quantized(
    model_bytes: bytes,
    wrapped: HydraPreTrainedModel,
    config: Any,
    names: list[str],
    vision: bool,
    opset: int,
    example: tuple,
    validation: Sequence[dict[str, Any]],
    ood_validation: Sequence[dict[str, Any]] | None,
    validation_name: str,
    min_agreement: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The int8 graph of the float32 graph ``model_bytes``, its calibration fit again on its own
    outputs for ``validation`` and the parity report; the graph is exported again with the refit
    temperature (part of the graph) and quantized again, which must give the same members' logits."""
    import numpy as np

    from ..hashing import batches_digest

    validation = list(validation)
    labels = np.concatenate([b["labels"].reshape(-1).numpy() for b in validation]).astype(np.int64)
    say(f"quantizing the graph to int8 (activation scales from {len(labels)} validation inputs)")
    feeds = graph_feeds(validation, names)
    int8 = quantize_int8(model_bytes, feeds)
    say(f"running the float32 and int8 graphs on {len(labels)} validation inputs")
    sessions = [inference_session(m) for m in (model_bytes, int8)]  # float32, int8
    reference, outputs = (run_graph(session, validation, names) for session in sessions)
    calibration = wrapped.calibration
    refitted = None
    if calibration is not None:
        refitted = refit(calibration, outputs, labels, validation_name, batches_digest(validation))
    ood = None
    if ood_validation and calibration is not None:
        ood_batches = list(ood_validation)
        ood = tuple(run_graph(session, ood_batches, names) for session in sessions)
    report = parity(reference, outputs, labels, calibration, refitted, ood)
    check_parity(report, min_agreement)
    if refitted is not None and refitted.temperature != calibration.temperature:
        say("exporting and quantizing again with the refit temperature (part of the graph)")
        int8 = _quantized_again(wrapped, refitted, config, names, vision, opset, example, feeds)
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
            "validation": validation_name,
            "parity": report.to_dict(),
            "calibration_fp32": None if calibration is None else calibration.to_dict(),
        },
    }


def _quantized_again(wrapped, calibration, config, names, vision, opset, example, feeds) -> bytes:
    """The int8 graph exported again with ``calibration`` in it (its temperature is part of the
    graph); the wrapper's own calibration is restored afterwards."""
    saved, wrapped.calibration = wrapped.calibration, calibration
    try:
        graph = _Graph(wrapped, names, *_vocabulary(config, vision)).eval()
        return quantize_int8(
            _export(graph, example, names, vision, opset).model_proto.SerializeToString(), feeds
        )
    finally:
        wrapped.calibration = saved


OUTPUTS = {
    "logits": "(batch, classes): log of the calibrated ensemble probabilities",
    "logits_per_member": "(batch, members, classes): the members' logits before calibration",
    "ood_score": "(batch,): the calibration's feature score (float64), the mean of the members'; "
    "flagged where > calibration.threshold",
    "ood_score_per_member": "(batch, members): each member's feature score (float64)",
}


def _sidecar(
    wrapped: HydraPreTrainedModel,
    config,
    names: list[str],
    difference: float | None,
    outputs: Sequence[str],
    vision: bool = False,
) -> dict:
    """``calibration.json``: what a runtime needs beside the graph (classes, inputs, outputs,
    the calibration) and how far the graph was from PyTorch."""
    return {
        "format": "hydra-ensembles/onnx",
        "classes": [str(config.id2label[i]) for i in range(int(config.num_labels))],
        "inputs": names,
        "outputs": {name: OUTPUTS[name] for name in outputs},
        "members": int(wrapped.ensemble.num_members),
        "calibration": None if wrapped.calibration is None else wrapped.calibration.to_dict(),
        "base_model_type": config.model_type,
        "max_difference_from_pytorch": difference,
        "max_length": None if vision else saved_length(wrapped.ensemble),
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


POSITION_OFFSET_FAMILIES = ("roberta", "xlm-roberta", "camembert", "mpnet")
"""Families whose position ids start after the padding id (usable positions: the table's size
less ``pad_token_id + 1``)."""


def _input_limits(config: Any, vision: bool) -> dict[str, int | None]:
    """What a feed may hold (`onnx_ops.check_feed`): a text model's positions and token types."""
    if vision:
        return {"max_positions": None, "type_vocab_size": None}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    if positions and text.model_type in POSITION_OFFSET_FAMILIES:
        positions -= int(getattr(text, "pad_token_id", 0) or 0) + 1
    types = getattr(text, "type_vocab_size", None)
    return {
        "max_positions": int(positions) if positions else None,
        "type_vocab_size": int(types) if types else None,
    }


def _vocabulary(config: Any, vision: bool) -> tuple[int | None, int | None]:
    """The token ids and token types a text model's embeddings hold (None: none, or images)."""
    if vision:
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return (int(size) if size else None), _input_limits(config, vision)["type_vocab_size"]


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


def _base_config(wrapped: HydraPreTrainedModel):
    ensemble = wrapped.ensemble
    return ensemble.config if hasattr(ensemble, "config") else ensemble.members[0].config


def _input_names(preprocessor: Any, vision: bool) -> list[str]:
    names = getattr(preprocessor, "model_input_names", None)
    if names:
        return list(names)
    return ["pixel_values"] if vision else ["input_ids", "attention_mask"]


def _example_inputs(config: Any, names: Sequence[str], vision: bool, batch: int, tokens: int, seed: int = 0):
    """Random inputs of the model's shapes: token ids within the vocabulary, a mask with padding in
    every other row, zero token types; images of the configured size."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for name in names:
        if name == "pixel_values":  # a composite config (CLIP's, SigLIP's) keeps them in vision_config
            vision_config = getattr(config, "vision_config", config)
            size, channels = int(vision_config.image_size), int(vision_config.num_channels)
            tensors.append(torch.randn(batch, channels, size, size, generator=g))
        elif name == "input_ids":
            tensors.append(torch.randint(1, int(config.vocab_size), (batch, tokens), generator=g))
        elif name == "attention_mask":
            mask = torch.ones(batch, tokens, dtype=torch.long)
            for row in range(1, batch, 2):
                mask[row, max(1, tokens - 2 - row) :] = 0
            tensors.append(mask)
        elif name == "token_type_ids":
            tensors.append(torch.zeros(batch, tokens, dtype=torch.long))
        else:
            raise ExportError(f"the graph cannot take the input {name!r}: give input_names the model takes")
    return tuple(tensors)


def _refused_rows(inputs: tuple, names: Sequence[str], vocab: int | None, types: int | None) -> tuple:
    """``inputs`` with row 0's attention mask all zeros, row 1 holding the id ``vocab``, row 2 the
    id -1 and row 3 the token type ``types``: rows PyTorch refuses or cannot read."""
    tensors = dict(zip(names, (t.clone() for t in inputs), strict=True))
    if "attention_mask" in tensors:
        tensors["attention_mask"][0] = 0
    if "input_ids" in tensors and vocab:
        tensors["input_ids"][1, 0] = vocab
        tensors["input_ids"][2, -1] = -1
    if "token_type_ids" in tensors and types:
        tensors["token_type_ids"][3, 0] = types
    return tuple(tensors[n] for n in names)


def _export(graph: nn.Module, example: tuple, names: Sequence[str], vision: bool, opset: int):
    try:
        import onnxscript  # noqa: F401  (torch's ONNX exporter needs it)
    except ImportError as exc:
        raise ExportError(
            "ONNX export needs onnx and onnxscript: pip install 'hydra-ensembles[onnx]'"
        ) from exc
    batch = torch.export.Dim.AUTO  # dynamic wherever the model allows; ranges inferred
    sequence = torch.export.Dim.AUTO  # (up to the model's positions)
    shapes = tuple(
        {0: batch} if vision or name == "pixel_values" else {0: batch, 1: sequence} for name in names
    )
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # notes on operators of packages not installed
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation notes, not the user's concern
            # guards the symbolic shapes solver cannot prove for every batch size (DINOv2's
            # layer scales give some) become runtime asserts instead of fixing the batch size;
            # the check below runs the graph on other sizes
            with member_attention_ops():
                program = torch.export.export(
                    graph,
                    example,
                    dynamic_shapes=(shapes,),  # one structure for forward's *tensors
                    strict=False,
                    prefer_deferred_runtime_asserts_over_guards=True,
                )
            exported = torch.onnx.export(
                program,
                dynamo=True,
                input_names=list(names),
                output_names=list(graph.output_names),
                opset_version=opset,
                custom_translation_table=translation_table(),
                verbose=False,
            )
            drop_unused_outputs(exported.model)
            fold_weights(exported.model)
    except Exception as exc:  # the exporter raises many kinds; one line with the cause
        lines = str(exc).splitlines()
        cause = next((line for line in lines if line.startswith("<class")), lines[0] if lines else "")
        raise ExportError(f"torch.onnx.export failed: {type(exc).__name__}: {cause}") from exc
    finally:
        exporter_log.setLevel(level)
    written = {o.version for o in exported.model_proto.opset_import if o.domain in ("", "ai.onnx")}
    if written != {opset}:
        raise ExportError(
            f"the exporter wrote opset {sorted(written)} where opset {opset} was asked (it supports "
            "18 and later): not written"
        )
    return exported


def _check(program: Any, graph: nn.Module, config: Any, names: Sequence[str], vision: bool) -> float:
    """Run the graph with onnxruntime on several shapes (one token; padded rows; for text, a batch
    whose rows hold a mask of zeros only, a token id past the vocabulary and a negative one, which
    must give NaN); ExportError where it differs from PyTorch."""
    try:
        import onnxruntime  # noqa: F401  (the check runs the graph)
    except ImportError as exc:
        raise ExportError(
            "checking the export needs onnxruntime: pip install 'hydra-ensembles[onnx]'"
        ) from exc
    session = inference_session(program.model_proto.SerializeToString())
    worst = 0.0
    shapes = [(1, 1), (1, 5), (3, 11), (5, 16)] + ([] if vision else [(4, 7)])
    for seed, (batch, tokens) in enumerate(shapes):
        inputs = _example_inputs(config, names, vision, batch, tokens, seed=seed + 1)
        refused = not vision and batch == 4
        refused_rows = 4 if graph.types and "token_type_ids" in names else 3  # `_refused_rows`
        if refused:
            inputs = _refused_rows(inputs, names, graph.vocab, graph.types)
        with torch.no_grad():
            expected = graph(*inputs)
        feed = {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
        try:
            got = session.run(list(graph.output_names), feed)
        except Exception as exc:  # onnxruntime's errors: a graph that fixed a shape, an operator
            raise ExportError(
                f"the exported graph does not run on batch {batch}, {tokens} tokens "
                f"({' '.join(str(exc).split())[:300]}): not written"
            ) from exc
        for name, ours, theirs in zip(graph.output_names, expected, got, strict=True):
            theirs = torch.from_numpy(theirs)
            if not torch.equal(theirs.isnan(), ours.isnan()) or (
                refused and not theirs[:refused_rows].isnan().all()
            ):
                raise ExportError(
                    f"the exported graph's {name} is NaN in other rows than PyTorch's (batch {batch}, "
                    f"{tokens} tokens; rows of zero masks, ids or types outside the vocabulary): not written"
                )
            ours, theirs = ours.nan_to_num(), theirs.nan_to_num()
            diff = float((theirs - ours).abs().max())
            if name in SCORE_NAMES:  # distances grow with the width: relative to their size
                diff /= max(1.0, float(ours.abs().max()))
            if not diff <= TOLERANCE:
                raise ExportError(
                    f"the exported graph's {name} differs from PyTorch's by {diff:.3g} (batch {batch}, "
                    f"{tokens} tokens; at most {TOLERANCE} is accepted): not written"
                )
            worst = max(worst, diff)
    return worst
