"""onnxruntime's own operators in the exported graph, and the session settings it runs fastest with.

The fused attention is exported as one ``com.microsoft.Attention`` operator per member (Q, K and V
projected, the heads' attention computed and laid out again in one kernel) instead of the
matrix products, transposes, splits and concatenations of its decomposed form; the int8 export
quantizes it into ``QAttention``. Measured on the exported MiniLM-L6 Hydra model, docs/benchmarks.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..layers.attention import member_attention  # noqa: F401  (registers torch.ops.hydra_ensembles)
from ..runtime import balanced_piece

MICROSOFT = "com.microsoft"
MASK_FILL = float(torch.finfo(torch.float32).min)
"""Added to the score of a key a query may not read: its probability is exactly 0 in float32,
as with PyTorch's boolean mask (onnxruntime's default, -10000, is not)."""

DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)
"""onnxruntime's fusion of a residual Add and LayerNormalization into SkipLayerNormalization:
its CPU kernel ran 4-5x slower than the two operators it replaces on (batch, tokens, hidden)
inputs (docs/benchmarks.md)."""


GRAPH_CACHE_SHARE = 0.3
"""Share of the cache (`runtime.chunk_cache_bytes`) one onnxruntime run's widest activation may
fill: onnxruntime keeps more of a forward's activations alive than PyTorch does, and its runs were
fastest at about a third of PyTorch's share (`benchmarks/onnx_chunks.py`; docs/benchmarks.md)."""


def translation_table() -> dict[Any, Any]:
    """The exporter's table from the library's operators to onnxruntime's."""
    import onnxscript

    microsoft = onnxscript.values.Opset(MICROSOFT, 1)
    _register_schema("Attention")
    ort_attention = microsoft.Attention

    def attention(x, weight, bias, mask=None, num_heads: int = 1, scale: float = 1.0):
        settings = {"num_heads": num_heads, "scale": scale, "mask_filter_value": MASK_FILL}
        output, _present = ort_attention(x, weight, bias, mask, **settings)
        return output

    return {torch.ops.hydra_ensembles.member_attention.default: attention}


def fold_weights(model: Any) -> None:
    """Fold the per-member slices and transposes of weights in the exported ``model`` (an
    ``onnx_ir`` model) into weights of their own, as large as the largest weight, so that every
    matrix product reads an initializer (what the int8 quantizer rewrites), and drop what
    nothing reads."""
    import onnxscript

    weights = model.graph.initializers.values()
    largest = max((w.const_value.size for w in weights if w.const_value is not None), default=0)
    onnxscript.optimizer.optimize(model, input_size_limit=largest, output_size_limit=largest)


def drop_unused_outputs(model: Any) -> None:
    """Remove the optional outputs nothing reads from onnxruntime's operators in the exported
    ``model`` (an ``onnx_ir`` model): the exporter writes every output of an operator it has a
    schema for, and onnxruntime computes each one written (``Attention``'s key/value cache)."""
    for node in model.graph:
        if node.domain != MICROSOFT:
            continue
        keep = len(node.outputs)
        while keep > 1 and not node.outputs[keep - 1].uses() and not node.outputs[keep - 1].is_graph_output():
            keep -= 1
        node.resize_outputs(keep)


def _register_schema(name: str) -> None:
    """Register onnxruntime's schema of its operator ``name`` with onnx, which has none of
    onnxruntime's own operators (the exporter checks every operator it writes against one)."""
    import onnx
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_schemas

    if onnx.defs.has(name, MICROSOFT):
        return
    (ours,) = (s for s in ort_schemas.get_all_operator_schema() if s.name == name and s.domain == MICROSOFT)
    schema, constraints = onnx.defs.OpSchema, ours.type_constraints

    def parameter(p):
        option = schema.FormalParameterOption.__members__[p.option.name]
        return schema.FormalParameter(p.name, p.typeStr, "", param_option=option)

    onnx.defs.register_schema(
        schema(
            name,
            MICROSOFT,
            ours.since_version,
            "",
            inputs=[parameter(p) for p in ours.inputs],
            outputs=[parameter(p) for p in ours.outputs],
            type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in constraints],
            attributes=[
                schema.Attribute(key, schema.AttrType.__members__[a.type.name], "", required=a.required)
                for key, a in ours.attributes.items()
            ],
        )
    )


def session_options(idle_spin: bool = True) -> Any:
    """onnxruntime `SessionOptions` for the exported graphs: all graph optimizations, threads as
    onnxruntime chooses (one per physical core); ``idle_spin=False``: its threads stop
    spin-waiting as soon as a run returns (they still spin within a run, where it pays), for a
    process that computes with other thread pools between runs (PyTorch's: on 2 cores a session
    left spinning made the PyTorch model timed after it 1.7x slower)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not idle_spin:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def inference_session(model: str | os.PathLike | bytes, options: Any = None) -> Any:
    """An onnxruntime CPU session for an exported graph (a path or its bytes), without
    `DISABLED_OPTIMIZERS`, with ``options`` (default: `session_options()`). A graph of an export
    folder is checked first against the folder's ``checksums.json`` (the graph, the sidecar and
    the preprocessor as exported): InputError in one line where any of them changed since."""
    import onnxruntime

    from ..saving.formats import check_folder_checksums

    if not isinstance(model, bytes):
        check_folder_checksums(Path(model).parent)
        model = str(model)

    return onnxruntime.InferenceSession(
        model,
        session_options() if options is None else options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(DISABLED_OPTIMIZERS),
    )


def runtime_settings(tokens_per_run: int | None, tokens_per_input: int | None) -> dict[str, Any]:
    """``calibration.json``'s ``onnxruntime`` entry: the optimizers to disable and how many
    tokens one ``run`` should take (`run_session`)."""
    return {
        "disabled_optimizers": list(DISABLED_OPTIMIZERS),
        "tokens_per_run": tokens_per_run,
        "tokens_per_input": tokens_per_input,
    }


def run_session(
    session: Any,
    feed: dict[str, np.ndarray],
    settings: dict[str, Any] | None = None,
    outputs: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """``session.run(outputs, feed)`` in runs of whole inputs holding at most ``settings``'
    ``tokens_per_run`` tokens (at least one input a run; runs of balanced sizes), the outputs'
    rows concatenated in order: what the fused model does in PyTorch to keep its activations in
    the cache (`HydraModel.chunk_token_rows`). ``tokens_per_input``: a vision model's tokens per
    image (text: the inputs' length). The feed is checked first (`check_feed`)."""
    feed = check_feed(session, feed, settings)
    rows = len(next(iter(feed.values())))
    budget = (settings or {}).get("tokens_per_run")
    per_run = rows
    if budget and rows > 1:
        length = (settings or {}).get("tokens_per_input") or next(
            (v.shape[1] for v in feed.values() if v.ndim >= 2), 1
        )
        per_run = balanced_piece(rows, int(budget) // int(length))
    if per_run >= rows:
        return session.run(outputs, feed)
    parts = [
        session.run(outputs, {k: v[i : i + per_run] for k, v in feed.items()})
        for i in range(0, rows, per_run)
    ]
    return [np.concatenate(values) for values in zip(*parts, strict=True)]


def check_feed(
    session: Any, feed: dict[str, Any], settings: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """``feed`` as the graph's inputs (int64 token ids, float32 pixels), or InputError in one line
    for what the graph cannot read as a whole: inputs missing or not the graph's, another dtype
    kind or rank, shapes that disagree, an empty sequence, more tokens than ``settings``'
    ``max_positions`` or token types past its ``type_vocab_size`` (the model's limits, recorded at
    export). Rows it reads but cannot answer (a token id outside the vocabulary, an attention
    mask of zeros only) are not refused here: the graph answers them with NaN."""
    expected = {i.name: i for i in session.get_inputs()}
    missing, extra = sorted(set(expected) - set(feed)), sorted(set(feed) - set(expected))
    if missing or extra:
        raise InputError(
            f"the graph takes the inputs {sorted(expected)}: {'missing ' + str(missing) if missing else ''}"
            f"{'; ' if missing and extra else ''}{'not its ' + str(extra) if extra else ''}"
        )
    checked, shapes = {}, {}
    for name, spec in expected.items():
        value = np.asarray(feed[name])
        integer = "int" in spec.type
        kind_ok = (
            np.issubdtype(value.dtype, np.integer) if integer else np.issubdtype(value.dtype, np.floating)
        )
        if not kind_ok or value.dtype == np.bool_:
            raise InputError(f"{name} must hold {'integers' if integer else 'floats'}, got {value.dtype}")
        if value.ndim != len(spec.shape):
            raise InputError(f"{name} must have {len(spec.shape)} dimensions, got shape {value.shape}")
        checked[name] = value.astype(np.int64 if integer else np.float32, copy=False)
        shapes[name] = value.shape
    rows = {shape[0] for shape in shapes.values()}
    lengths = {shape[1] for name, shape in shapes.items() if name != "pixel_values" and len(shape) > 1}
    if len(rows) > 1 or len(lengths) > 1:
        raise InputError(f"the inputs' shapes disagree: {shapes}")
    length = lengths.pop() if lengths else None
    limits = settings or {}
    if length == 0:
        raise InputError("the inputs hold an empty sequence (0 tokens): give at least one token per row")
    if length is not None and limits.get("max_positions") and length > limits["max_positions"]:
        raise InputError(
            f"the inputs hold {length} tokens, more than the model's {limits['max_positions']} positions: "
            "truncate them (the tokenizer saved beside the graph does, with truncation=True)"
        )
    types, kinds = checked.get("token_type_ids"), limits.get("type_vocab_size")
    if types is not None and types.size and kinds and (types.min() < 0 or types.max() >= kinds):
        raise InputError(f"token_type_ids hold {int(types.max())}: the model has {kinds} token types")
    return checked
