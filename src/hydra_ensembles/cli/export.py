"""``hydra-ens export``: a saved Hydra model, member or ensemble as one ONNX graph with its calibration."""

from __future__ import annotations

import argparse
import json
import sys

from .options import _overwrite_option


def _cmd_export(args: argparse.Namespace) -> int:
    from ..io import check_output_dir
    from ..loading import load_preprocessor
    from ..serving.onnx import ONNX_NAME, SIDECAR_NAME, export_onnx

    check_output_dir(args.out, finished=ONNX_NAME, overwrite=args.overwrite, replaced=True)
    preprocessor = load_preprocessor(args.preprocessor) if args.preprocessor else None
    out = export_onnx(args.model, args.out, preprocessor=preprocessor, opset=args.opset)
    sidecar = json.loads((out / SIDECAR_NAME).read_text())
    calibration = sidecar["calibration"]
    print(
        f"exported {sidecar['members']} member(s) to {out / ONNX_NAME}: inputs {sidecar['inputs']}, "
        f"outputs logits and logits_per_member; onnxruntime matches PyTorch within "
        f"{sidecar['max_difference_from_pytorch']:.2g}"
    )
    if calibration is None:
        print("the model has no saved calibration: temperature 1 and no OOD flag threshold", file=sys.stderr)
    else:
        print(
            f"{out / SIDECAR_NAME}: classes, temperature {calibration['temperature']:.3f}, OOD flag threshold"
        )
    return 0


def _add_export_command(sub) -> None:
    export = sub.add_parser(
        "export",
        help="export a saved Hydra model, member or ensemble as one ONNX graph with its calibration",
        description=(
            "Write MODEL as one ONNX graph (every member and the aggregation; dynamic batch and "
            "sequence axes) to --out/model.onnx, with calibration.json (classes, temperature, OOD "
            "score and threshold) and the preprocessor beside it. The graph is run by onnxruntime "
            "and compared with PyTorch before it is kept (at most 1e-4 apart)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    export.add_argument("model", help="a folder saved by hydra-ens build, fuse, finetune or the Python API")
    export.add_argument("--format", choices=["onnx"], default="onnx", help="the export format")
    export.add_argument("--out", required=True, help="output directory (replaced as a whole)")
    export.add_argument("--opset", type=int, default=18, help="ONNX opset version")
    export.add_argument(
        "--preprocessor", help="where the tokenizer or image processor is, if not saved in MODEL"
    )
    _overwrite_option(export)
    export.set_defaults(func=_cmd_export)
