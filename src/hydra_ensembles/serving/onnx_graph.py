"""The graph of an export: the served model's forward with named tensor inputs (`ExportGraph`),
exported by ``torch.export`` and the ONNX exporter, and checked against PyTorch in onnxruntime
on several input shapes, rows PyTorch refuses among them."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layers.attention import member_attention_ops
from ..models import VISION_MODEL_TYPES
from ..ood.registry import feature_scores
from .modeling import HydraPreTrainedModel
from .onnx_ops import drop_unused_outputs, fold_weights, inference_session, translation_table
from .quantization import ExportError

OUTPUT_NAMES = ("logits", "logits_per_member")
SCORE_NAMES = ("ood_score", "ood_score_per_member")
TOLERANCE = 1e-4
"""The largest difference (fp32) accepted between onnxruntime's outputs and PyTorch's."""


class ExportGraph(nn.Module):
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
        self.scored = calibration is not None and calibration.flag.score in feature_scores()
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


POSITION_OFFSET_FAMILIES = ("roberta", "xlm-roberta", "camembert", "mpnet")
"""Families whose position ids start after the padding id (usable positions: the table's size
less ``pad_token_id + 1``)."""


def input_limits(config: Any, vision: bool) -> dict[str, int | None]:
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


def vocabulary(config: Any, vision: bool) -> tuple[int | None, int | None]:
    """The token ids and token types a text model's embeddings hold (None: none, or images)."""
    if vision:
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return (int(size) if size else None), input_limits(config, vision)["type_vocab_size"]


@dataclass(frozen=True)
class GraphSpec:
    """What every graph of one export shares: the base model's ``config``, the graph's input
    ``names``, whether it reads images, and the ONNX ``opset`` written."""

    config: Any
    names: tuple[str, ...]
    vision: bool
    opset: int

    @classmethod
    def of(cls, wrapped: HydraPreTrainedModel, preprocessor: Any, names: Sequence[str] | None, opset: int):
        """The spec of ``wrapped``'s export: inputs named by ``names``, else by ``preprocessor``."""
        config = _base_config(wrapped)
        vision = config.model_type in VISION_MODEL_TYPES
        return cls(config, tuple(names or _input_names(preprocessor, vision)), vision, opset)

    def example(self, batch: int = 2, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random inputs of the graph's shapes (`_example_inputs`)."""
        return _example_inputs(self.config, self.names, self.vision, batch, tokens, seed)

    def graph(self, wrapped: HydraPreTrainedModel) -> ExportGraph:
        """``wrapped``'s forward as the graph computes it, refused rows NaN."""
        return ExportGraph(wrapped, self.names, *vocabulary(self.config, self.vision)).eval()

    def export(self, graph: ExportGraph):
        """``graph`` exported on `example`'s inputs (`_export`): dynamic batch and length."""
        return _export(graph, self.example(), self.names, self.vision, self.opset)

    def check(self, program: Any, graph: ExportGraph) -> float:
        """The largest difference from PyTorch on several shapes (`_check`); ExportError past
        `TOLERANCE`."""
        return _check(program, graph, self.config, self.names, self.vision)


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
    _check_opset(exported, opset)
    return exported


def _check_opset(exported: Any, opset: int) -> None:
    """ExportError where the exporter wrote another opset than ``opset`` (it writes 18 and later)."""
    written = {o.version for o in exported.model_proto.opset_import if o.domain in ("", "ai.onnx")}
    if written != {opset}:
        raise ExportError(
            f"the exporter wrote opset {sorted(written)} where opset {opset} was asked (it supports "
            "18 and later): not written"
        )


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
