"""``hydra-ens info``: a model's family, layers and heads."""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra_ensembles.errors import InputError

from .command import Command
from .options import _num_labels_option


def _cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hydra_ensembles.adapters import get_adapter
    from hydra_ensembles.baselines.registry import MEMBER_TRANSFORMS
    from hydra_ensembles.cost import count_parameters
    from hydra_ensembles.fusion import HydraModel
    from hydra_ensembles.loading import load_any
    from hydra_ensembles.members.ensemble import DeepEnsemble
    from hydra_ensembles.surgery import kept_heads

    if args.families:
        from hydra_ensembles.adapters import supported_families

        print("supported families:")
        for family in supported_families():
            print(f"  {family}")
        return 0
    if _is_export(args.model):
        return _describe_export(Path(args.model))
    model = load_any(args.model, args.num_labels)  # a HF classifier, a saved member or Hydra model
    if isinstance(model, DeepEnsemble):  # a saved ensemble of members: each member described
        print(f"model: {args.model} (an ensemble of {model.num_members} saved members)")
        for m, member in enumerate(model.members):
            original = get_adapter(member).original_heads_per_layer(member)
            kept = [len(k) for k in kept_heads(member).resolve(original)]
            print(f"  member {m}: {type(member).__name__}, heads per layer {kept} of {original}")
        _print_calibration(model)
        print(f"parameters: {sum(count_parameters(m) for m in model.members):,}")
        return 0
    if isinstance(model, HydraModel):
        adapter, inner = model.adapter, model.model
        original = adapter.original_heads_per_layer(inner)
        print(f"model: {args.model} (fused Hydra of {type(inner).__name__}, family {adapter.family})")
        print(f"members: {model.num_members}; shared trunk: {model.trunk_layers} layers")
        for m, heads in enumerate(model.head_sets):
            print(f"  member {m}: heads per layer {[len(k) for k in heads.resolve(original)]} of {original}")
        print(f"fusion policy: {asdict(model.policy)}; per-member modules: {len(model.layout)}")
        _print_calibration(model)
        print(f"parameters: {count_parameters(model):,} (without padding)")
        return 0
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    kept = kept_heads(model).resolve(original)
    print(f"model: {args.model} ({type(model).__name__}, family {adapter.family})")
    for transform in MEMBER_TRANSFORMS.values():
        if transform.stacked_members(model) > 1:
            print(transform.describe(transform.record(model)))
    print(f"layers: {len(original)}; heads per layer: {[len(k) for k in kept]} of {original}")
    blocks = [adapter.attention_block(model, layer) for layer in range(len(original))]
    if any(b.kv_index is not None and len(set(b.kv_index)) < b.num_heads for b in blocks):
        kv = [b.key.out_features // b.head_dim for b in blocks]
        print(f"key/value heads per layer (grouped-query attention): {kv}")
    _print_calibration(model)
    print(f"parameters: {count_parameters(model):,}")
    return 0


def _is_export(path: str) -> bool:
    from hydra_ensembles.serving.onnx import ONNX_NAME, SIDECAR_NAME

    return (Path(path) / ONNX_NAME).is_file() and (Path(path) / SIDECAR_NAME).is_file()


def _describe_export(folder: Path) -> int:
    """An ONNX export (`hydra-ens export`): its graph, classes, inputs and outputs, calibration
    and, for a quantized graph, what quantization changed."""
    from hydra_ensembles.calibration.calibration import Calibration
    from hydra_ensembles.saving.files import read_json
    from hydra_ensembles.saving.formats import check_folder_checksums
    from hydra_ensembles.serving.onnx import ONNX_NAME, SIDECAR_NAME

    check_folder_checksums(folder)  # the graph, the sidecar, the tokenizer as exported
    side = read_json(folder / SIDECAR_NAME, "export sidecar")
    if not isinstance(side, dict) or side.get("format") != "hydra-ensembles/onnx":
        raise InputError(f"{folder / SIDECAR_NAME} is not the sidecar of a hydra-ens ONNX export")
    quantization = side.get("quantization")
    kind = "int8 weights" if quantization else "float32"
    members, family = side["members"], side["base_model_type"]
    print(f"ONNX export: {folder / ONNX_NAME} ({kind}), {members} member(s) of {family}")
    print(f"classes: {', '.join(side['classes'])}")
    print(f"inputs: {', '.join(side['inputs'])}; outputs: {', '.join(side['outputs'])}")
    if side.get("calibration") is not None:
        print(f"calibration: {Calibration.from_dict(side['calibration']).describe()}")
    if side.get("max_length") is not None:
        print(f"fit at {side['max_length']} tokens per text (the saved tokenizer cuts to it)")
    if quantization:
        parity = quantization["parity"]
        print(
            f"quantized: {quantization['weights']}; on {parity['examples']} validation inputs top-1 "
            f"agreement {parity['agreement']:.2%}, NLL {parity['nll_fp32']:.4f} -> {parity['nll_refit']:.4f}"
        )
    return 0


def _print_calibration(model) -> None:
    """The calibration saved with the model, where it has one, the length it was fit at and how
    it was trained, where recorded."""
    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.data.registry import saved_length
    from hydra_ensembles.training import training_summary

    calibration = saved_calibration(model)
    if calibration is not None:
        print(f"calibration: {calibration.describe()}")
    if (length := saved_length(model)) is not None:
        print(f"fit at {length} tokens per text (predict, eval and the pipelines cut texts to it)")
    if (trained := training_summary(model)) is not None:
        print(f"fine-tuned: {trained} since the pretrained weights")


def _add_info_arguments(info: argparse.ArgumentParser) -> None:
    from hydra_ensembles.models import DEFAULT_TEXT_MODEL

    info.add_argument(
        "model", nargs="?", default=DEFAULT_TEXT_MODEL, help="HF id, local directory or minilm-l6"
    )
    info.add_argument("--families", action="store_true", help="list the supported model families and exit")
    _num_labels_option(info)


COMMAND = Command(
    "info",
    help="show a model's family, layers and heads",
    add_arguments=_add_info_arguments,
    run=_cmd_info,
)
