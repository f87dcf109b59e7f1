"""``hydra-ens zero-shot``: a zero-shot Hydra model from a dual encoder, without training."""

from __future__ import annotations

import argparse

from .command import Command
from .common import _calibrate, _data_batches, _say_precision
from .options import (
    COUNT,
    POSITIVE,
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _overwrite_option,
    _positive_float,
)


def _cmd_zero_shot(args: argparse.Namespace) -> int:
    from hydra_ensembles.build import save_preprocessor
    from hydra_ensembles.data import load_spec
    from hydra_ensembles.loading import load_preprocessor
    from hydra_ensembles.members import member_overlap, sample_members
    from hydra_ensembles.models import load_image_processor, takes_images
    from hydra_ensembles.saving.files import atomic_write_json
    from hydra_ensembles.scoring import CircuitConfig, CircuitOrder, extract_circuit
    from hydra_ensembles.surgery import original_heads_per_layer
    from hydra_ensembles.zero_shot import fuse_dual_encoder, load_dual_encoder

    from .guards import check_output_dir

    out = check_output_dir(
        args.out,
        finished="zero-shot/zero_shot_config.json",
        resumable=("circuit-checkpoint.json", "circuit.json", "zero-shot"),
        overwrite=args.overwrite,
    )
    id_data = load_spec(args.data, args.text_column, args.label_column)
    classes = [c.strip() for c in args.labels.split(",")] if args.labels else list(id_data.classes)
    dual = load_dual_encoder(args.model, classes, args.template, args.scale, args.heads)
    # the input tower's preprocessor: CLIP's image processor (its folder holds the tokenizer too)
    source = args.preprocessor or args.model
    preprocessor = load_image_processor(source) if takes_images(dual) else load_preprocessor(source)
    print(
        f"zero-shot classifier: {dual.config.num_labels} classes {classes}; "
        f"prompts: {dual.config.prompts()[:3]}"
    )
    _, id_val = _data_batches(args.data, args, preprocessor, args.limit, model=dual, dataset=id_data)
    ood_val = _data_batches(args.ood_data, args, preprocessor, args.limit, labels=False, model=dual)[1]
    _say_precision(args)
    if (out / "circuit.json").is_file():
        order = CircuitOrder.load(out / "circuit.json")
    else:
        settings = CircuitConfig(objective=args.objective, budget=args.pool_size, precision=args.precision)
        order = extract_circuit(dual, id_val, ood_val, settings, checkpoint=out / "circuit-checkpoint.json")
        atomic_write_json(out / "circuit.json", order.to_dict())
    heads = sample_members(
        order, args.members, num_pruned=args.num_pruned, pool_size=args.pool_size, seed=args.seed
    )
    overlap = member_overlap(heads, original_heads_per_layer(dual)).round(2).tolist()
    print(f"Jaccard overlap between members: {overlap}")
    model = fuse_dual_encoder(dual, heads, progress=True)
    # on the ID and OOD validation data the circuit used
    _calibrate(model, id_val, args, args.data, ood=ood_val)
    save_preprocessor(preprocessor, out / "zero-shot")
    model.save_pretrained(out / "zero-shot")  # its config last: the marker of a finished run
    (out / "circuit-checkpoint.json").unlink(missing_ok=True)
    print(f"saved the zero-shot Hydra to {out / 'zero-shot'} (hydra-ens eval/predict take it)")
    return 0


def _add_zero_shot_arguments(zs: argparse.ArgumentParser) -> None:
    zs.add_argument(
        "model", help="a CLIPModel, a SiglipModel or a sentence-transformers checkpoint (HF id or directory)"
    )
    zs.add_argument("--labels", help="class names, comma-separated (default: the --data class names)")
    zs.add_argument(
        "--template",
        action="append",
        help="prompt template with {} for the class name; repeat to average several "
        "(default: 'A photo of a {}.' for CLIP, '{}' for sentence encoders)",
    )
    zs.add_argument(
        "--scale",
        type=_positive_float,
        help="logit scale of a sentence encoder (default 20, its training loss's; CLIP brings its own)",
    )
    zs.add_argument(
        "--heads",
        choices=["both", "input"],
        default="both",
        help="prune both towers, or the input tower only",
    )
    zs.add_argument(
        "--data",
        required=True,
        help="labelled ID validation data (images or texts): the circuit's, and the calibration's "
        "saved with the model",
    )
    zs.add_argument("--ood-data", required=True, help="OOD *validation* data (never a test set)")
    zs.add_argument("--objective", choices=["acc", "ood", "avg"], default="avg")
    zs.add_argument("--members", type=POSITIVE, default=3)
    zs.add_argument("--num-pruned", type=COUNT, default=24, help="heads each member prunes (both towers)")
    zs.add_argument("--pool-size", type=POSITIVE, default=48, help="least useful heads members sample from")
    zs.add_argument("--limit", type=POSITIVE, help="use at most this many items of each data set")
    zs.add_argument("--seed", type=int, default=0)
    zs.add_argument("--out", required=True, help="output directory (zero-shot/, circuit.json)")
    zs.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _calibration_options(zs, "--data", ood_option=False)
    _overwrite_option(zs)
    _data_options(zs)


COMMAND = Command(
    "zero-shot",
    help="zero-shot Hydra from a dual encoder (CLIP, SigLIP or a sentence encoder): circuit over the "
    "heads of both towers -> members -> fused zero-shot model, no training",
    add_arguments=_add_zero_shot_arguments,
    run=_cmd_zero_shot,
)
