"""Quantized ONNX graphs whose calibration is refit on their own outputs, with a parity report.

Quantizing a classifier's weights moves its probabilities and, more, its OOD scores (on a
MiniLM classifier, int8 weights moved the Mahalanobis score by a median 6% with one scale per
output channel, 23% with one per weight matrix; docs/serving.md): the
temperature, flag threshold and prediction-set quantiles fit for the float32 model no longer hold
for the quantized graph, and nothing says so. Here the float32 graph is quantized (int8 weights
of every float32 matrix product, per output channel, int8 activations at scales fixed on the
validation inputs: onnxruntime's static quantization, so a row's record does not depend on its
batch), both graphs are run on the user's labelled ID
validation data, the saved calibration is fit again on the quantized graph's outputs (same
score, level and methods; the conformal guarantees then hold for the graph that is served), and
what changed is reported (`Parity`). A graph whose top-1 predictions agree with the float32
graph's on fewer than ``min_agreement`` of the inputs is refused.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import metrics as M
from ..batching import model_inputs
from ..calibration.calibration import Calibration
from ..calibration.provenance import DataRecord, Provenance
from ..errors import InputError
from ..evaluation.conformal import flags as raised
from ..evaluation.conformal import one_draw_range
from ..evaluation.predict import Predictions
from ..ood.registry import feature_scores

QUANTIZATIONS = ("int8",)
MAX_AUROC_DROP = 0.02
"""The most the int8 graph's flag may lose of the float32 graph's AUROC against the OOD validation
data (``--ood-data``) before the export is refused (what int8 did to each score on the text
benchmark: docs/serving.md)."""
MIN_AGREEMENT = 0.99
"""The default least share of ID validation inputs whose predicted class the quantized graph
must keep."""
MIN_ONNXRUNTIME = (1, 32)
"""Older releases' quantizer names the transposed weights of the Gemm nodes it rewrites without
checking for names already in the graph, and fails (or could mix weights up) on these graphs."""


class ExportError(InputError):
    """The exported graph cannot be written, or does not compute what the model computes."""


@dataclass(frozen=True)
class Quantization:
    """How an export is quantized (``export_onnx(..., quantize=Quantization(...))``): ``kind``
    (`QUANTIZATIONS`); the labelled ID ``validation`` batches the calibration is fit again on, from
    the quantized graph's own outputs (named ``validation_name`` where recorded); the unlabelled
    ``ood_validation`` batches the flag's AUROC is compared on (optional); the least share of
    validation inputs whose top-1 class must agree with the float32 graph's (``min_agreement``)."""

    validation: Sequence[dict[str, Any]]
    ood_validation: Sequence[dict[str, Any]] | None = None
    validation_name: str = ""
    min_agreement: float = MIN_AGREEMENT
    kind: str = "int8"

    def __post_init__(self) -> None:
        # held as tuples: read more than once (checked, quantized on, run, digested), never consumed
        object.__setattr__(self, "validation", tuple(self.validation))
        if self.ood_validation is not None:
            object.__setattr__(self, "ood_validation", tuple(self.ood_validation))
        if self.kind not in QUANTIZATIONS:
            raise ExportError(f"unknown quantization {self.kind!r}; choose from {QUANTIZATIONS}")
        if not self.validation:
            raise ExportError(
                "a quantized graph is calibrated again on its own outputs: give labelled ID validation "
                "batches (--val-data)"
            )
        if not 0 < self.min_agreement <= 1:
            raise ExportError(f"min_agreement is a share in (0, 1], got {self.min_agreement}")


@dataclass(frozen=True)
class Parity:
    """What quantization changed, measured on labelled ID validation data (and OOD validation
    data where given): top-1 agreement with the float32 graph, the largest change of a calibrated
    probability, NLL and ECE (15 bins) of the float32 graph at its calibration, of the quantized
    graph at that same calibration and at the one refit on it, the ID flag rate at the float32
    threshold and at the refit one, and the flag score's AUROC against the OOD validation data."""

    examples: int
    agreement: float
    max_probability_change: float
    nll_fp32: float
    nll_quantized: float
    nll_refit: float
    ece_fp32: float
    ece_quantized: float
    ece_refit: float
    flag_rate_fp32: float | None = None
    flag_rate_quantized: float | None = None
    flag_rate_refit: float | None = None
    flag_rate_held_out: float | None = None
    """The refit flag's rate on validation inputs it was not fit on (refit on the even-numbered
    inputs and measured on the odd ones, and the other way round): what the served graph's rate
    is expected to be, unlike ``flag_rate_refit``, which is measured on the inputs it was fit on."""
    flag_rate_ceiling: float | None = None
    """The rate a calibration draw of that size stays under for 95% of draws
    (`evaluation.conformal.one_draw_range`): a held-out rate above it has drifted."""
    flag_agreement_held_out: float | None = None
    """On those same held-out inputs, the share the refit int8 flag decides as the float32
    graph's flag does (at its own calibration): how often the served graphs' flags agree."""
    ood_auroc_fp32: float | None = None
    ood_auroc_quantized: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantize_int8(model_bytes: bytes, feeds: Sequence[dict[str, np.ndarray]]) -> bytes:
    """The graph ``model_bytes`` with int8 weights (per output channel) for its float32 matrix
    products and int8 activations whose scales are fixed from the float32 graph's activations on
    ``feeds`` (onnxruntime's static quantization, min-max), so that each row's outputs do not
    depend on the other rows of its batch (dynamic quantization takes each activation's scale from
    the whole batch); products in other types (the float64 feature scores) are kept as they are."""
    import onnxruntime
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from packaging.version import Version

    if Version(onnxruntime.__version__).release[:2] < MIN_ONNXRUNTIME:
        raise InputError(
            f"int8 quantization needs onnxruntime >= {'.'.join(map(str, MIN_ONNXRUNTIME))} "
            f"(installed: {onnxruntime.__version__}): pip install -U onnxruntime"
        )
    if not feeds:
        raise InputError("int8 activations are calibrated on inputs: give at least one batch of them")

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.left, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # notes on the float64 products it leaves alone
    try:
        with tempfile.TemporaryDirectory(prefix="hydra-quantize-") as folder:
            source, target = Path(folder) / "fp32.onnx", Path(folder) / "int8.onnx"
            source.write_bytes(model_bytes)
            quantize_static(
                source,
                target,
                Feeds(),
                quant_format=QuantFormat.QOperator,
                op_types_to_quantize=["MatMul", "Gemm"],
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                extra_options={"MatMulConstBOnly": True},
            )
            return target.read_bytes()
    finally:
        root.setLevel(level)


def graph_feeds(batches: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """The graph's inputs ``names`` of each of ``batches``, as onnxruntime takes them."""
    inputs = (model_inputs(batch) for batch in batches)
    return [{name: tensors[name].numpy() for name in names} for tensors in inputs]


def run_graph(session: Any, batches: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Every output of the onnxruntime ``session`` on ``batches`` (the inputs ``names``), rows
    concatenated in order."""
    outputs = [o.name for o in session.get_outputs()]
    got: dict[str, list[np.ndarray]] = {name: [] for name in outputs}
    for feed in graph_feeds(batches, names):
        for name, value in zip(outputs, session.run(outputs, feed), strict=True):
            got[name].append(value)
    return {name: np.concatenate(values) for name, values in got.items()}


def graph_predictions(outputs: dict[str, np.ndarray], labels: np.ndarray | None) -> Predictions:
    """The members' logits of a graph's outputs as `Predictions`."""
    return Predictions(outputs["logits_per_member"].astype(np.float32).transpose(1, 0, 2), labels)


def flag_scores(outputs: dict[str, np.ndarray], calibration: Calibration) -> np.ndarray:
    """The calibration's flag score of each row of a graph's outputs: the graph's ``ood_score``
    for a feature score, else computed from its members' logits at the calibration's temperature."""
    from ..evaluation.evaluate import ood_scores

    if calibration.flag.score in feature_scores():
        return outputs["ood_score"].astype(np.float64)
    return ood_scores(graph_predictions(outputs, None), calibration.flag.score, calibration.temperature)


def refit(
    calibration: Calibration, outputs: dict[str, np.ndarray], labels: np.ndarray, data: str, digest: str
) -> Calibration:
    """``calibration`` fit again, with its score, level and methods, on a graph's outputs for
    the labelled ID validation inputs (``data``, batches digest ``digest``)."""
    predictions = graph_predictions(outputs, labels)
    scores = outputs["ood_score"] if calibration.flag.score in feature_scores() else None
    return Calibration.fit(
        predictions,
        calibration.config,
        provenance=Provenance(DataRecord(data, digest), calibration.provenance.statistics),
        precision="int8",
        model_sha256=calibration.model_sha256,
        statistics=calibration.flag.statistics,
        id_scores=scores,
    )


def _held_out_flag_rate(
    calibration: Calibration,
    outputs: dict[str, np.ndarray],
    labels: np.ndarray,
    reference_flags: np.ndarray | None = None,
) -> dict:
    """``flag_rate_held_out``, ``flag_rate_ceiling`` and, with the float32 graph's flags on the
    same inputs as ``reference_flags``, ``flag_agreement_held_out`` (see `Parity`); nothing where
    half the validation inputs cannot fit the calibration."""
    import warnings

    halves = (slice(0, None, 2), slice(1, None, 2))
    rates, agreeing = [], []
    for fit_rows, test_rows in (halves, halves[::-1]):
        part = {name: value[fit_rows] for name, value in outputs.items()}
        try:
            with warnings.catch_warnings():  # a half's small-sample warnings are not the export's
                warnings.simplefilter("ignore")
                fitted = refit(calibration, part, labels[fit_rows], "", "")
        except InputError:
            return {}
        rest = {name: value[test_rows] for name, value in outputs.items()}
        flagged = raised(flag_scores(rest, fitted), fitted.flag.threshold)
        rates.append(float(np.mean(flagged)))
        if reference_flags is not None:
            agreeing.append(float(np.mean(flagged == reference_flags[test_rows])))
    ceiling = (
        one_draw_range(len(labels) // 2, calibration.flag.alpha)[1]
        if calibration.flag.method == "conformal"
        else None
    )
    agreement = {"flag_agreement_held_out": float(np.mean(agreeing))} if agreeing else {}
    return {"flag_rate_held_out": float(np.mean(rates)), "flag_rate_ceiling": ceiling, **agreement}


def parity(
    reference: dict[str, np.ndarray],
    quantized: dict[str, np.ndarray],
    labels: np.ndarray,
    calibration: Calibration | None,
    refitted: Calibration | None,
    ood: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
) -> Parity:
    """`Parity` of the quantized graph's outputs against the float32 graph's on the same inputs;
    ``ood``: both graphs' outputs on OOD validation data."""
    temperature = calibration.temperature if calibration is not None else 1.0
    after = refitted.temperature if refitted is not None else temperature
    ref, quant = graph_predictions(reference, labels), graph_predictions(quantized, labels)
    p_ref, p_quant, p_refit = ref.probs(temperature), quant.probs(temperature), quant.probs(after)
    flags: dict[str, float | None] = {}
    aurocs: dict[str, float | None] = {}
    if calibration is not None and refitted is not None:
        ref_scores, quant_scores = flag_scores(reference, calibration), flag_scores(quantized, calibration)
        refit_scores = flag_scores(quantized, refitted)
        ref_flags = raised(ref_scores, calibration.flag.threshold)
        flags = {
            "flag_rate_fp32": float(np.mean(ref_flags)),
            "flag_rate_quantized": float(np.mean(raised(quant_scores, calibration.flag.threshold))),
            "flag_rate_refit": float(np.mean(raised(refit_scores, refitted.flag.threshold))),
            **_held_out_flag_rate(refitted, quantized, labels, ref_flags),
        }
        if ood is not None:
            aurocs = {
                "ood_auroc_fp32": M.auroc(ref_scores, flag_scores(ood[0], calibration)),
                "ood_auroc_quantized": M.auroc(refit_scores, flag_scores(ood[1], refitted)),
            }
    return Parity(
        examples=len(labels),
        agreement=float(np.mean(p_ref.argmax(-1) == p_quant.argmax(-1))),
        max_probability_change=float(np.abs(p_ref - p_refit).max()),
        nll_fp32=M.nll(p_ref, labels),
        nll_quantized=M.nll(p_quant, labels),
        nll_refit=M.nll(p_refit, labels),
        ece_fp32=M.ece(p_ref, labels),
        ece_quantized=M.ece(p_quant, labels),
        ece_refit=M.ece(p_refit, labels),
        **flags,
        **aurocs,
    )


def check_parity(report: Parity, min_agreement: float) -> None:
    """Warn where the refit int8 flag's held-out rate drifted above what a calibration of that size
    stays under; ExportError where the flag's AUROC against OOD validation data falls by more than
    `MAX_AUROC_DROP`, or fewer than ``min_agreement`` of the inputs keep their class."""
    drifted = report.flag_rate_held_out is not None and report.flag_rate_ceiling is not None
    if drifted and report.flag_rate_held_out > report.flag_rate_ceiling:
        warnings.warn(
            f"the int8 graph's refit flag raised {report.flag_rate_held_out:.1%} of validation inputs it "
            f"was not fit on, above the {report.flag_rate_ceiling:.1%} a calibration of that size stays "
            "under for 95% of draws: quantization moved the flag score unevenly; check the parity "
            "report, or serve the float32 graph",
            stacklevel=4,
        )
    if report.ood_auroc_quantized is not None and (
        report.ood_auroc_quantized < report.ood_auroc_fp32 - MAX_AUROC_DROP
    ):
        raise ExportError(
            f"the int8 graph's flag separates the OOD validation data with AUROC "
            f"{report.ood_auroc_quantized:.4f} against the float32 graph's {report.ood_auroc_fp32:.4f} "
            f"(at most {MAX_AUROC_DROP} lower accepted): not written; serve the float32 graph, or "
            "calibrate on a score int8 keeps (hydra-ens calibrate --flag-score ...) and export again"
        )
    if report.agreement < min_agreement:
        raise ExportError(
            f"the int8 graph predicts another class than the float32 graph for {1 - report.agreement:.1%} "
            f"of the {report.examples} validation inputs (at most {1 - min_agreement:.1%} accepted): not "
            "written; a lower --min-agreement accepts it"
        )
