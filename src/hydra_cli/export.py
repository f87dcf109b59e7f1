"""``hydra-ens export``: a saved Hydra model, member or ensemble as one ONNX graph with its calibration."""

from __future__ import annotations

import argparse
import json
import sys

from hydra_ensembles.errors import InputError

from .command import Command
from .options import PREPROCESSOR_HELP, _data_options, _fraction, _overwrite_option


def _cmd_export(args: argparse.Namespace) -> int:
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.serving.onnx import ONNX_NAME, SIDECAR_NAME, Quantization, export_onnx

    from .guards import check_output_dir

    check_output_dir(args.out, finished=ONNX_NAME, overwrite=args.overwrite, replaced=True)
    if (args.val_data or args.ood_data) and not args.quantize:
        raise InputError("--val-data and --ood-data calibrate a quantized graph: give --quantize int8")
    if args.quantize and not args.val_data:
        raise InputError("--quantize refits the calibration on the quantized graph: give --val-data")
    preprocessor = load_preprocessor(args.preprocessor) if args.preprocessor else None
    val = ood = None
    if args.quantize:
        val, ood = _validation(args, preprocessor)
    quantize = None
    if args.quantize:
        quantize = Quantization(val, ood, args.val_data or "", args.min_agreement, kind=args.quantize)
    out = export_onnx(
        args.model,
        args.out,
        preprocessor=preprocessor,
        opset=args.opset,
        quantize=quantize,
        log=lambda line: print(f"export: {line}", file=sys.stderr, flush=True),
    )
    sidecar = json.loads((out / SIDECAR_NAME).read_text())
    calibration = sidecar["calibration"]
    if args.quantize:
        _print_parity(sidecar["quantization"]["parity"], calibration["flag"]["score"] if calibration else "")
    print(
        f"exported {sidecar['members']} member(s) to {out / ONNX_NAME}: inputs {sidecar['inputs']}, "
        f"outputs {', '.join(sidecar['outputs'])}; onnxruntime matches PyTorch within "
        f"{sidecar['max_difference_from_pytorch']:.2g}"
        + (" (the float32 graph it was quantized from)" if args.quantize else "")
    )
    if calibration is None:
        print("the model has no saved calibration: temperature 1 and no OOD flag threshold", file=sys.stderr)
    else:
        print(
            f"{out / SIDECAR_NAME}: classes, temperature {calibration['temperature']:.3f}, OOD flag threshold"
        )
    return 0


def _validation(args: argparse.Namespace, preprocessor) -> tuple[list, list | None]:
    """The labelled ID validation batches (and unlabelled OOD validation batches) a quantized
    graph is calibrated and compared on, read through the model's preprocessor."""
    from hydra_ensembles.loading import load_any
    from hydra_ensembles.loading import load_preprocessor as saved

    from .common import _data_batches

    model = load_any(args.model)
    preprocessor = preprocessor or saved(args.model)
    val = _data_batches(args.val_data, args, preprocessor, model=model)[1]
    ood = (
        _data_batches(args.ood_data, args, preprocessor, labels=False, model=model)[1]
        if args.ood_data
        else None
    )
    return list(val), None if ood is None else list(ood)


def _print_parity(parity: dict, score: str) -> None:
    """What quantization changed, in a few lines."""
    print(
        f"int8 graph on {parity['examples']} validation inputs: top-1 agreement with float32 "
        f"{parity['agreement']:.2%}; NLL {parity['nll_fp32']:.4f} (float32) -> {parity['nll_quantized']:.4f} "
        f"-> {parity['nll_refit']:.4f} (calibration refit); ECE {100 * parity['ece_fp32']:.2f}% -> "
        f"{100 * parity['ece_quantized']:.2f}% -> {100 * parity['ece_refit']:.2f}%"
    )
    if parity.get("flag_rate_fp32") is not None:
        print(
            f"ID flag rate: {parity['flag_rate_fp32']:.2%} (float32) -> {parity['flag_rate_quantized']:.2%} "
            f"at the float32 threshold -> {parity['flag_rate_refit']:.2%} at the refit one"
            + (
                f" ({parity['flag_rate_held_out']:.2%} on validation inputs it was not fit on, its flag "
                f"deciding as float32's on {parity['flag_agreement_held_out']:.2%} of them; 95% of "
                f"calibration draws stay under {parity['flag_rate_ceiling']:.2%})"
                if parity.get("flag_rate_held_out") is not None
                and parity.get("flag_rate_ceiling") is not None
                else ""
            )
        )
    if parity.get("ood_auroc_fp32") is not None:
        before, after = parity["ood_auroc_fp32"], parity["ood_auroc_quantized"]
        print(f"flag score AUROC against --ood-data: {before:.4f} (float32), {after:.4f} (int8)")
    elif parity.get("flag_rate_fp32") is not None:
        print(
            f"hydra-ens: warning: without --ood-data nothing measured what int8 did to the flag ({score}); "
            "a score reading every layer lost most of its separation under int8 on the text benchmark "
            "(docs/serving.md): give --ood-data, and an export whose flag loses more than 0.02 AUROC is "
            "refused",
            file=sys.stderr,
        )


def _add_export_arguments(export: argparse.ArgumentParser) -> None:
    from hydra_ensembles.serving.quantization import MIN_AGREEMENT, QUANTIZATIONS

    export.add_argument("model", help="a folder saved by hydra-ens build, fuse, finetune or the Python API")
    export.add_argument("--format", choices=["onnx"], default="onnx", help="the export format")
    export.add_argument("--out", required=True, help="output directory (replaced as a whole)")
    export.add_argument(
        "--opset", type=int, default=20, help="ONNX opset version (from 20, GELU is one operator)"
    )
    export.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    export.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        help="int8: int8 weights (per output channel) for the matrix products, int8 activations at "
        "scales fixed on --val-data (a row's record does not depend on its batch); the calibration is "
        "fit again on the quantized graph's outputs for --val-data, and calibration.json records what "
        "changed (docs/serving.md)",
    )
    export.add_argument("--val-data", help="labelled ID validation data (with --quantize)")
    export.add_argument(
        "--ood-data",
        help="unlabelled OOD validation data (with --quantize): the flag score's AUROC, before and after; "
        "a flag that loses more than 0.02 of it is refused",
    )
    export.add_argument(
        "--min-agreement",
        type=_fraction,
        default=MIN_AGREEMENT,
        help="least share of --val-data inputs whose predicted class the quantized graph keeps; "
        "below it nothing is written",
    )
    _overwrite_option(export)
    _data_options(export, precision=False)


COMMAND = Command(
    "export",
    help="export a saved Hydra model, member or ensemble as one ONNX graph with its calibration",
    description="Write MODEL as one ONNX graph (every member and the aggregation; dynamic batch and "
    "sequence axes) to --out/model.onnx, with calibration.json (classes, temperature, OOD "
    "score and threshold) and the preprocessor beside it. The graph is run by onnxruntime "
    "and compared with PyTorch before it is kept (at most 1e-4 apart). With --quantize int8 "
    "the graph written has int8 weights, its calibration fit again on its own outputs for "
    "--val-data, with a parity report.",
    add_arguments=_add_export_arguments,
    run=_cmd_export,
)
