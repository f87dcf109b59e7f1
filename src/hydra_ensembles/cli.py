"""The ``hydra-ens`` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .data import MissingDataError
from .evaluation.evaluate import OOD_SCORES
from .models import DEFAULT_IMAGE_MODEL, DEFAULT_TEXT_MODEL, MissingModelError

PREPROCESSOR_HELP = (
    "a model directory or hub id to load the tokenizer (text) or image processor (images) from, "
    "instead of the first model's own (needed for a saved Hydra model, which keeps none)"
)
NUM_LABELS_HELP = "classes of a freshly initialised head (default: the saved head; 2 where none is saved)"
PRECISION_HELP = (
    "compute precision: auto (default) picks bf16 only where this machine computes it natively and "
    "measurably faster (a CPU with AMX or AVX-512 BF16, confirmed by a small timed probe; a GPU "
    "with bf16, else fp16) and fp32 otherwise (e.g. AVX2-only CPUs, where bf16 is emulated and far "
    "slower); fp32, bf16 or fp16 force one. HYDRA_PRECISION=fp32|bf16|fp16 sets what auto picks"
)


def _cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from .adapters import get_adapter
    from .cost import count_parameters
    from .fusion import HydraModel
    from .loading import load_any
    from .members import batch_ensemble_members, head_ensemble_members
    from .members.mimo import mimo_members
    from .members.packed import PACKED_KEY
    from .surgery import kept_heads

    model = load_any(args.model, args.num_labels)  # a HF classifier, a saved member or Hydra model
    if isinstance(model, HydraModel):
        adapter, inner = model.adapter, model.model
        original = adapter.original_heads_per_layer(inner)
        print(f"model: {args.model} (fused Hydra of {type(inner).__name__}, family {adapter.family})")
        print(f"members: {model.num_members}; shared trunk: {model.trunk_layers} layers")
        for m, heads in enumerate(model.head_sets):
            print(f"  member {m}: heads per layer {[len(k) for k in heads.resolve(original)]} of {original}")
        print(f"fusion policy: {asdict(model.policy)}; per-member modules: {len(model.layout)}")
        print(f"parameters: {count_parameters(model):,} (without padding)")
        return 0
    adapter = get_adapter(model)
    original = adapter.original_heads_per_layer(model)
    kept = kept_heads(model).resolve(original)
    print(f"model: {args.model} ({type(model).__name__}, family {adapter.family})")
    if (members := batch_ensemble_members(model)) > 1:
        print(f"BatchEnsemble of {members} members (rank-1 factors on every linear layer)")
    if (members := head_ensemble_members(model)) > 1:
        print(f"Deep Ensemble (D): one backbone, {members} task heads")
    if packing := getattr(model.config, PACKED_KEY, None):
        print("Packed-Ensemble: {members} members, alpha {alpha}, gamma {gamma}".format(**packing))
    if (members := mimo_members(model)) > 1:
        print(f"MIMO: {members} inputs mixed into one pass, {members} task heads")
    print(f"layers: {len(original)}; heads per layer: {[len(k) for k in kept]} of {original}")
    print(f"parameters: {count_parameters(model):,}")
    return 0


def _cmd_fuse(args: argparse.Namespace) -> int:
    from .fusion import fuse
    from .fusion.model import CONFIG_NAME
    from .heads import HeadSet, HeadSetError
    from .io import check_output_dir, read_json

    check_output_dir(args.out, finished=CONFIG_NAME, resumable=(), overwrite=args.overwrite)
    head_sets = []
    for file in args.heads:
        data = read_json(file, "head-set file")
        items = data if isinstance(data, list) else [data]
        if not items or not all(isinstance(item, dict) for item in items):
            raise HeadSetError(f"{file}: a head set {{layer: [heads]}} or a non-empty list of them is due")
        try:
            head_sets += [HeadSet.from_dict(item) for item in items]
        except (HeadSetError, TypeError, ValueError) as exc:
            raise HeadSetError(f"{file}: {exc}") from None
    model = _load_model(args.model, args)
    hydra = fuse(model, head_sets)
    hydra.save_pretrained(args.out)
    print(f"fused {hydra.num_members} members into {args.out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .io import check_output_dir
    from .serving.onnx import ONNX_NAME, SIDECAR_NAME, export_onnx

    check_output_dir(args.out, finished=ONNX_NAME, overwrite=args.overwrite, replaced=True)
    preprocessor = _preprocessor_for(args.preprocessor) if args.preprocessor else None
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


def _load_model(path: str, args: argparse.Namespace, num_labels: int | None = None):
    """A model for a command that predicts with its head: refused where the head was initialised
    randomly (a base model) unless ``--allow-random-head`` says that is intended."""
    from .loading import load_any
    from .models import untrained_weights

    model = load_any(path, num_labels or getattr(args, "num_labels", None))
    untrained = untrained_weights(model)
    if untrained and not getattr(args, "allow_random_head", False):
        raise ValueError(
            f"{path} has no trained classifier head ({', '.join(untrained[:2])} would be random): "
            f"fine-tune it first (hydra-ens finetune {path} --data TRAIN --out DIR), or pass "
            "--allow-random-head where a random head is what you want"
        )
    if untrained:
        print(
            f"hydra-ens: warning: {path}: {', '.join(untrained)} initialised randomly (seeded)",
            file=sys.stderr,
        )
    return model


def _cmd_demo(args: argparse.Namespace) -> int:
    from .experiment import DemoConfig, run_demo
    from .io import output_lock
    from .runtime import ensure_cpu_allocator_tuned

    ensure_cpu_allocator_tuned()
    overrides = {
        "precision": args.precision,
        "seed": args.seed,
        "cache_dir": Path(args.cache_dir),
        "use_cache": not args.no_cache,
        "trunk_study": args.trunk_study,
        "batch_ensemble": args.batch_ensemble,
        "oba": args.oba,
        "wanda": args.wanda,
        "packed": args.packed,
        "mimo": args.mimo,
    }
    if args.model:
        overrides["model"] = args.model
    if args.out:
        overrides["out_dir"] = Path(args.out)
    config = DemoConfig.preset(args.task, full=args.full, **overrides)
    if args.seeds and args.task == "zero-shot":
        raise ValueError("--seeds runs the supervised demos (text, image)")
    with output_lock(config.out_dir):  # its default folder too: one demo writes it at a time
        if args.seeds:
            from .experiment import run_seeds

            run_seeds(config, [int(s) for s in args.seeds.split(",") if s.strip()])
        elif args.task == "zero-shot":
            from .zero_shot_demo import run_zero_shot_demo

            run_zero_shot_demo(config)
        else:
            run_demo(config)
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from .analyze import analysis_config, run_analysis
    from .io import output_lock
    from .runtime import ensure_cpu_allocator_tuned

    ensure_cpu_allocator_tuned()
    config = analysis_config(
        args.task,
        studies=tuple(s.strip() for s in args.studies.split(",") if s.strip()),
        out_dir=Path(args.out or ("runs/analysis" if args.task == "text" else f"runs/analysis-{args.task}")),
        items=args.items,
        probes=args.probes,
        max_members=args.max_members,
        bootstrap=args.bootstrap,
        cache_dir=Path(args.cache_dir),
        precision=args.precision,
    )
    with output_lock(config.out_dir):
        run_analysis(config)
    return 0


def _preprocessor_for(model_path: str):
    """What a model's inputs are made with: the tokenizer saved with a text model, the image
    processor saved with a vision model (``build`` saves them beside members and the fused model
    too), or None (a model saved without one)."""
    from transformers import AutoConfig

    from .configuration import MODEL_TYPE
    from .loading import saved_preprocessor
    from .members.ensemble import CONFIG_NAME as ENSEMBLE_CONFIG
    from .models import VISION_MODEL_TYPES, load_image_processor, load_tokenizer, resolve_model_path

    found = saved_preprocessor(model_path)
    if found is not None or (Path(model_path) / ENSEMBLE_CONFIG).is_file():
        return found
    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model_path))
    except (OSError, ValueError):
        return None
    if config.model_type == MODEL_TYPE:  # a folder the library saved: its preprocessor is saved in it
        return None
    if config.model_type in VISION_MODEL_TYPES:
        return load_image_processor(model_path)
    return load_tokenizer(model_path)


def _data_batches(
    spec: str,
    args: argparse.Namespace,
    preprocessor,
    limit: int | None = None,
    labels: bool = True,
    model=None,
    dataset=None,
):
    """A named dataset and its batches; with ``model``, checked against it (text or images) and
    its labels mapped onto the model's classes (`data.labels.align_labels`). ``dataset``: the
    one ``spec`` names, where the caller has loaded it already."""
    from .batching import model_inputs
    from .data import ImageDataset, load_spec, stable_sample, to_batches
    from .data.labels import align_labels, model_class_names, num_model_labels
    from .models import takes_images

    if dataset is None:
        dataset = load_spec(spec, args.text_column, args.label_column, labelled=labels)
    if labels and not dataset.classes:
        raise ValueError(f"{spec} has no labels; this option needs labelled data")
    if model is not None:
        first = model[0] if isinstance(model, list) else model
        vision = takes_images(first)
        if vision != isinstance(dataset, ImageDataset):
            kind = "images" if isinstance(dataset, ImageDataset) else "texts"
            raise ValueError(f"{spec} holds {kind}, but the model takes {'images' if vision else 'text'}")
        if labels:
            dataset = align_labels(dataset, model_class_names(model), num_model_labels(model), spec)
    if preprocessor is None and not isinstance(dataset, ImageDataset):
        raise ValueError(
            "text data needs a tokenizer and none was found with the model; pass --tokenizer MODEL "
            "where the command takes it (a saved Hydra model keeps none)"
        )
    if not isinstance(dataset, ImageDataset):
        _check_max_length(args.max_length, preprocessor, model)
    if limit:
        dataset = dataset.subset(stable_sample(range(len(dataset)), dataset.ids, limit, salt="cli"))
    out = list(to_batches(dataset, preprocessor, args.batch_size, args.max_length))
    if not labels:
        out = [model_inputs(b) for b in out]
    return dataset, out


def _check_max_length(max_length: int, tokenizer, model) -> None:
    """Refuse a ``--max-length`` beyond the positions the tokenizer and the model know (longer
    inputs would index past the position embeddings)."""
    limits = [getattr(tokenizer, "model_max_length", None)]
    for m in model if isinstance(model, list) else [model]:
        config = getattr(m, "config", None)
        limits.append(getattr(config, "max_position_embeddings", None) if config is not None else None)
    known = [int(n) for n in limits if isinstance(n, int) and 0 < n < 1_000_000]
    if known and max_length > min(known):
        raise ValueError(f"--max-length {max_length} exceeds the model's {min(known)} positions")


def _cmd_score(args: argparse.Namespace) -> int:
    from .io import atomic_write_json, check_output_file
    from .scoring import extract_circuit, taylor_head_set, taylor_scores
    from .scoring.taylor import DECIDING_PRECISION

    check_output_file(args.out, (".json",))
    if args.checkpoint:
        check_output_file(args.checkpoint, (".json",))
    model = _load_model(args.model, args)
    preprocessor = _preprocessor_for(args.preprocessor or args.model)
    _, data = _data_batches(args.data, args, preprocessor, args.limit, model=model)
    _say_precision(args)
    if args.method == "taylor":
        # a ranking file decides which heads members prune: scored in fp32 on every machine
        scores = taylor_scores(model, data, progress=True, precision=DECIDING_PRECISION)
        heads = taylor_head_set(model, data, args.heads_per_layer, scope=args.scope)
        out = {
            "method": "taylor",
            "scores": scores.tolist(),
            "head_set": heads.to_dict(),
            "heads_per_layer": args.heads_per_layer,
            "scope": args.scope,
        }
    else:
        ood = (
            _data_batches(args.ood_data, args, preprocessor, args.limit, labels=False, model=model)[1]
            if args.ood_data
            else None
        )
        order = extract_circuit(
            model,
            data,
            ood,
            objective=args.objective,
            budget=args.budget,
            min_heads_per_layer=args.min_heads_per_layer,
            checkpoint=args.checkpoint,
            method="lazy" if args.lazy else "fast",
            shortlist=args.lazy or 8,
            refresh_every=args.refresh_every,
            cache_gb=args.cache_gb,
            precision=args.precision,
        )
        out = {"method": "circuit", **order.to_dict()}
    out.update(precision=args.precision, precision_reason=args.precision_reason)
    atomic_write_json(args.out, out)
    if args.checkpoint and not args.keep_checkpoint:
        Path(args.checkpoint).unlink(missing_ok=True)
    print(f"wrote {args.out}")
    return 0


def _ranking(scores_file: str, model):
    """The head ranking a ``hydra-ens score`` file holds, checked against ``model``'s heads."""
    import torch

    from .adapters import get_adapter
    from .io import read_json
    from .members import least_useful_first
    from .scoring import CircuitOrder

    data = read_json(scores_file, "scores file")
    method = data.get("method") if isinstance(data, dict) else None
    if method not in ("taylor", "circuit"):
        raise ValueError(f"{scores_file} is not a file written by hydra-ens score")
    heads = list(get_adapter(model).original_heads_per_layer(model))
    try:
        ranking = (
            torch.tensor(data["scores"], dtype=torch.float64)
            if method == "taylor"
            else CircuitOrder.from_dict(data)
        )
        ranked_heads = least_useful_first(ranking)[1]  # heads per layer the ranking covers
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{scores_file} is damaged or does not fit {type(model).__name__}: {exc}") from None
    if ranked_heads != heads:
        raise ValueError(
            f"{scores_file} ranks a model with heads per layer {ranked_heads}; this one has {heads}"
        )
    return ranking


def _cmd_build(args: argparse.Namespace) -> int:
    import dataclasses
    import shutil

    from .build import BuildConfig, build_hydra, save_with_preprocessor
    from .data.labels import check_trainable
    from .io import check_output_dir
    from .members import FineTuneConfig, member_overlap
    from .surgery import heads_per_layer

    out = check_output_dir(
        args.out,
        finished="hydra/hydra_config.json",
        resumable=("checkpoints", "members", "hydra"),
        overwrite=args.overwrite,
    )
    if args.fine_tune and not args.data:
        raise ValueError("--fine-tune needs --data (labelled training data)")
    model = _load_model(args.model, args)
    ranking = _ranking(args.scores, model)
    preprocessor = _preprocessor_for(args.preprocessor or args.model)
    _say_precision(args)
    train, classes = None, None
    if args.fine_tune:
        dataset, train = _data_batches(args.data, args, preprocessor, model=model)
        check_trainable(dataset.labels, dataset.classes, args.data)
        classes = list(dataset.classes)  # saved models name their classes (predict, pipelines)
    val = _data_batches(args.val_data, args, preprocessor, model=model)[1] if args.val_data else None
    tuning = None
    if args.fine_tune:
        tuning = FineTuneConfig(epochs=args.epochs, lr=args.lr, seed=args.seed, patience=args.patience)
    config = BuildConfig(
        num_members=args.members,
        num_pruned=args.num_pruned,
        heads_per_layer=args.heads_per_layer,
        pool_size=args.pool_size,
        seed=args.seed,
        fine_tune=tuning,
        mlp=args.mlp,
        flag_score=args.flag_score,
        keep=args.keep,
        precision=args.precision,
    )

    def trained(m: int, member, result) -> None:  # each member saved as soon as it is trained
        _print_history(result, dataclasses.replace(tuning, seed=args.seed + m), val)
        save_with_preprocessor(member, out / "members" / f"member-{m}", preprocessor)

    built = build_hydra(
        model,
        train,
        val,
        config=config,
        ranking=ranking,
        classes=classes,
        validation_name=args.val_data or "",
        checkpoint_dir=out / "checkpoints",
        on_member=trained,
        log=lambda line: print(line, file=sys.stderr),
    )
    overlap = member_overlap(built.head_sets, heads_per_layer(model))
    print(f"{len(built.head_sets)} members; Jaccard overlap between members: {overlap.round(2).tolist()}")
    for what, calibration in (
        ("members' ensemble (members/)", built.members_calibration),
        ("fused model (hydra/)", built.calibration),
    ):
        if calibration is not None:
            print(f"the {what}: calibration: {calibration.describe()}")
    built.save_pretrained(out, preprocessor, members_saved=True)  # the fused model's config last
    if not args.keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print(f"saved the fused model to {out / 'hydra'}")
    return 0


def _cmd_zero_shot(args: argparse.Namespace) -> int:
    from .build import save_preprocessor
    from .data import load_spec
    from .io import atomic_write_json, check_output_dir
    from .members import member_overlap, sample_members
    from .models import load_image_processor, takes_images
    from .scoring import CircuitOrder, extract_circuit
    from .surgery import heads_per_layer
    from .zeroshot import fuse_dual_encoder, load_dual_encoder

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
    preprocessor = load_image_processor(source) if takes_images(dual) else _preprocessor_for(source)
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
        order = extract_circuit(
            dual,
            id_val,
            ood_val,
            args.objective,
            args.pool_size,
            checkpoint=out / "circuit-checkpoint.json",
            precision=args.precision,
        )
        atomic_write_json(out / "circuit.json", order.to_dict())
    heads = sample_members(
        order, args.members, num_pruned=args.num_pruned, pool_size=args.pool_size, seed=args.seed
    )
    print(
        f"Jaccard overlap between members: {member_overlap(heads, heads_per_layer(dual)).round(2).tolist()}"
    )
    model = fuse_dual_encoder(dual, heads, progress=True)
    _calibrate(model, id_val, args, args.data)  # on the ID validation data the circuit used
    save_preprocessor(preprocessor, out / "zero-shot")
    model.save_pretrained(out / "zero-shot")  # its config last: the marker of a finished run
    (out / "circuit-checkpoint.json").unlink(missing_ok=True)
    print(f"saved the zero-shot Hydra to {out / 'zero-shot'} (hydra-ens eval/predict take it)")
    return 0


def _print_history(result, config, val: list[dict] | None) -> None:
    """One line per fine-tuning epoch (training loss; validation NLL/accuracy where measured),
    which epoch was kept and why (``--patience``), and a warning where validation accuracy never
    rose above the share of the validation set's largest class (a model stuck on one class)."""
    import warnings

    history = result.history
    for record in history:
        line = f"  epoch {record['epoch'] + 1}: train loss {record['train_loss']:.4f}"
        if "val_nll" in record:
            line += f", val NLL {record['val_nll']:.4f}, val accuracy {record['val_acc']:.4f}"
        if record.get("fp16_overflow_retries"):
            line += f", {record['fp16_overflow_retries']} fp16 steps taken again at a halved loss scale"
        if record.get("skipped_steps"):
            line += f", {record['skipped_steps']} steps SKIPPED (fp16 gradients overflowed)"
        print(line)
    if config.patience is not None and result.best_epoch is not None:
        best = history[result.best_epoch]
        stopped = f"; stopped early after epoch {len(history)}" if result.stopped_early else ""
        print(
            f"  kept epoch {result.best_epoch + 1} of {len(history)}: the lowest validation NLL "
            f"({best['val_nll']:.4f}; --patience keeps the best epoch by validation NLL){stopped}"
        )
    if val and history and "val_acc" in history[0]:
        import torch

        labels = torch.cat([b["labels"].reshape(-1) for b in val])
        majority = float(torch.bincount(labels).max()) / len(labels)
        if max(r["val_acc"] for r in history) <= majority + 1e-9:
            warnings.warn(
                f"validation accuracy never rose above {majority:.3f}, the share of the largest class: "
                "the model predicts one class; try a larger --lr or more --epochs",
                stacklevel=2,
            )


def _cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a classifier (e.g. a base model's fresh head) and save it as a Hugging Face model
    directory with its preprocessor and class names: what score and build start from."""
    import shutil

    from .build import name_classes
    from .data import load_spec
    from .data.labels import check_trainable
    from .io import atomic_dir, check_output_dir
    from .members import FineTuneConfig, fine_tune
    from .models import untrained_weights

    out = check_output_dir(
        args.out, finished="config.json", resumable=(), overwrite=args.overwrite, replaced=True
    )
    if args.val_data and args.flag_score == "mutual_information":
        raise ValueError(
            "--flag-score mutual_information measures members' disagreement: a single fine-tuned "
            "model has none to calibrate; choose msp, max_logit, energy or entropy"
        )
    dataset = load_spec(args.data, args.text_column, args.label_column)
    classes = len(dataset.classes)
    if not classes:
        raise ValueError(f"{args.data} has no labels; fine-tuning needs labelled data")
    check_trainable(dataset.labels, dataset.classes, args.data)
    model = _load_model(args.model, args, num_labels=args.num_labels)
    if untrained_weights(model) and args.num_labels is None and model.config.num_labels != classes:
        model = _load_model(args.model, args, num_labels=classes)  # a fresh head for the data
    preprocessor = _preprocessor_for(args.preprocessor or args.model)
    dataset, train = _data_batches(args.data, args, preprocessor, model=model, dataset=dataset)
    val = _data_batches(args.val_data, args, preprocessor, model=model)[1] if args.val_data else None
    name_classes(model, dataset.classes)
    config = FineTuneConfig(
        epochs=args.epochs,
        lr=args.lr,
        seed=args.seed,
        patience=args.patience,
        precision=args.precision,
        trainable=tuple(args.train.split(",")),
    )
    checkpoint = out.with_name(out.name + ".checkpoint")
    _say_precision(args)
    result = fine_tune(model, train, val, config, checkpoint_dir=checkpoint)
    _print_history(result, config, val)
    model.config.hydra_training_precision = args.precision  # saved with its config
    if val is not None:
        _calibrate(model, val, args, args.val_data)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)  # safetensors + config.json (with the class names)
        if preprocessor is not None:
            preprocessor.save_pretrained(folder)

    atomic_dir(out, write)
    if not args.keep_checkpoints:
        shutil.rmtree(checkpoint, ignore_errors=True)
    print(f"saved the fine-tuned classifier ({len(dataset.classes)} classes) to {out}")
    return 0


def _calibrate(model, batches: list[dict], args: argparse.Namespace, data: str):
    """Fit ``model``'s calibration (temperature, ``--flag-score`` threshold keeping ``--keep`` of
    ID validation) on labelled ``batches`` and record it in its configuration, saved with it."""
    from .evaluation import calibrate

    calibration = calibrate(model, batches, args.flag_score, args.keep, data=data, precision=args.precision)
    print(f"calibration: {calibration.describe()}")
    return calibration


def _cmd_eval(args: argparse.Namespace) -> int:
    from . import reporting
    from .evaluation import add_comparisons, evaluate_method, predict, predict_method
    from .io import check_report_dir, mark_report_dir

    out = check_report_dir(args.out, args.overwrite)
    items = [item.partition("=") for item in args.method]
    bad = [f"{n}{sep}{paths}" for n, sep, paths in items if not (n and sep and paths)]
    if bad:
        raise ValueError(f"--method wants NAME=PATH[,PATH...], got {bad[0]!r}")
    oods_named = [_ood_option(item) for item in args.ood or []]
    for option, names in (("--method", [n for n, _, _ in items]), ("--ood", [n for n, _, _ in oods_named])):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{option} names {repeated[0]!r} twice: give every {option} its own name")
    methods: dict[str, list] = {}
    preprocessor = None
    for name, _, paths in items:
        methods[name], found = _load_methods(paths, args)
        preprocessor = preprocessor or found
    models = [m for group in methods.values() for m in group]  # mapping labels checks they agree
    if args.preprocessor:
        preprocessor = _preprocessor_for(args.preprocessor)
    data = _eval_data(args, preprocessor, models, oods_named)
    _say_precision(args)
    results, preds, draws = {}, {}, {}
    for name, group in methods.items():

        def predict_fn(model, batches, split, name=name):
            return predict(model, batches, f"{name}: {split}", precision=args.precision)

        model = group[0] if len(group) == 1 else group
        preds[name] = predict_method(model, data, predict_fn, calibrate=data.val is not None)
        rows, _, row_draws = evaluate_method(name, preds[name], bootstrap=args.bootstrap)
        results.update(rows)
        draws.update(row_draws)
    first = next(iter(methods))  # every other method's differences from the first, paired
    add_comparisons(results, draws, [(name, first) for name in results if name != first])
    meta = {
        "command": "hydra-ens eval",
        "ID": args.id_data,
        "OOD": ", ".join(args.ood or []) or "none",
        "precision": f"{args.precision} ({args.precision_reason})",
    }
    reporting.write_results(mark_report_dir(out), results, meta=meta)
    reporting.method_plots(out / "plots", preds, list(preds), list(preds))
    print((out / "report.md").read_text())
    return 0


def _ood_option(item: str) -> tuple[str, str, str]:
    """``NAME=SPEC:near|far`` -> (name, spec, kind)."""
    name, _, rest = item.partition("=")
    spec, _, kind = rest.rpartition(":")
    if kind not in ("near", "far") or not spec or not name:
        raise ValueError(f"--ood wants NAME=SPEC:near|far, got {item!r}")
    return name, spec, kind


def _eval_data(args: argparse.Namespace, preprocessor, models: list, oods_named: list):
    """The ID test (and shifted, validation) and OOD batches ``hydra-ens eval`` measures on."""
    from .data import to_batches
    from .evaluation import EvalData, shifted_sets

    id_dataset, id_test = _data_batches(args.id_data, args, preprocessor, args.limit, model=models)
    shift = {
        key: list(to_batches(data, preprocessor, args.batch_size, args.max_length))
        for key, data in (shifted_sets(id_dataset, args.shift_limit) if args.shift else {}).items()
    }
    oods = {
        name: (kind, _data_batches(spec, args, preprocessor, args.limit, labels=False, model=models[0])[1])
        for name, spec, kind in oods_named
    }
    val = (
        _data_batches(args.val_data, args, preprocessor, args.limit, model=models)[1]
        if args.val_data
        else None
    )
    return EvalData(id_test, oods, shift, val)


def _load_methods(spec: str, args: argparse.Namespace) -> tuple[list, object]:
    """Models named by ``PATH[,PATH...]`` (several = an explicit ensemble) and, where the first
    path has one, its tokenizer or image processor (a saved Hydra model or member keeps none:
    pass ``--tokenizer``)."""
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise ValueError(f"no model path in {spec!r}")
    return [_load_model(p, args) for p in paths], _preprocessor_for(paths[0])


def _cmd_predict(args: argparse.Namespace) -> int:
    import csv
    import io
    from functools import partial

    from . import reporting
    from .evaluation import fit_calibration, ood_scores, per_example, saved_calibration
    from .evaluation import predict as predict_any
    from .io import atomic_write_text, check_output_file

    out = check_output_file(args.out, (".csv", ".jsonl"))
    predict = partial(predict_any, precision=args.precision)
    models, preprocessor = _load_methods(args.model, args)
    if args.preprocessor:
        preprocessor = _preprocessor_for(args.preprocessor)
    model = models[0] if len(models) == 1 else models
    dataset, batches = _data_batches(args.data, args, preprocessor, labels=args.labelled, model=models)
    classes = dataset.classes if args.labelled and dataset.classes else None
    if classes is None:
        id2label = getattr(models[0].config, "id2label", None) or {}
        classes = [str(id2label.get(i, id2label.get(str(i), i))) for i in range(len(id2label))] or None
    val_batches = _data_batches(args.val_data, args, preprocessor, model=models)[1] if args.val_data else None
    calibration = None if val_batches is not None or len(models) > 1 else saved_calibration(model)
    if calibration is not None and (args.flag_score or calibration.score, args.keep or calibration.keep) != (
        calibration.score,
        calibration.keep,
    ):
        raise ValueError(
            f"{args.model}'s saved calibration flags on {calibration.score} keeping {calibration.keep:.0%} "
            "of ID validation: pass --val-data to fit another with --flag-score/--keep"
        )
    flag_score = args.flag_score or "msp"
    _say_precision(args)
    val = None
    if val_batches is not None:
        calibration, val = fit_calibration(
            model, val_batches, flag_score, args.keep or 0.95, data=args.val_data, precision=args.precision
        )
        print(f"calibration fit on --val-data (not saved with the model): {calibration.describe()}")
    elif calibration is not None:
        print(f"calibration saved with the model: {calibration.describe()}")
    else:
        print(
            f"hydra-ens: warning: {args.model} carries no calibration and no --val-data was given: "
            "probabilities at temperature 1 and no OOD flag (fit one with build/finetune/zero-shot "
            "--val-data, or pass --val-data here)",
            file=sys.stderr,
        )
    preds = predict(model, batches, "predict")
    if calibration is not None:
        records = calibration.records(preds, classes)
    else:
        records = per_example(preds, classes, flag_score=flag_score)
    if val is not None:  # where the data's scores fall against ID validation, and the threshold
        scores = {
            f"ID validation ({args.val_data})": ood_scores(val, flag_score, calibration.temperature),
            f"data ({args.data})": ood_scores(preds, flag_score, calibration.temperature),
        }
        plot = out.with_name(f"{out.stem}_{flag_score}.png")
        reporting.score_histograms(scores, plot, flag_score, calibration.threshold)
    texts = getattr(dataset, "texts", None)
    rows = [
        {"id": dataset.ids[i], **({"text": texts[i]} if texts else {}), **record}
        for i, record in enumerate(records)
    ]
    if out.suffix == ".jsonl":
        atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(out, buffer.getvalue())
    summary = [f"{len(rows)} predictions -> {out}"]
    if val is not None:
        summary.append(f"score histograms -> {plot}")
    if calibration is not None:
        flagged = sum(r["flagged"] for r in rows) / len(rows)
        summary.append(
            f"flagged (ood_score_{calibration.score} > {calibration.threshold:.4f}, keeping "
            f"{calibration.keep:.0%} of ID validation): {flagged:.1%}"
        )
    if args.labelled:
        summary.append(f"accuracy {sum(r['correct'] for r in rows) / len(rows):.4f}")
    print("\n".join(summary))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .adapters import get_adapter
    from .bench import bench_report, random_head_sets, run_bench
    from .io import atomic_write_json, atomic_write_text, check_report_dir, mark_report_dir
    from .loading import load_any
    from .models import VISION_MODEL_TYPES
    from .precision import resolve_precision
    from .runtime import ALLOCATOR_ENV, describe_machine, ensure_cpu_allocator_tuned

    out = check_report_dir(args.out, args.overwrite)
    if args.default_allocator:
        os.environ[ALLOCATOR_ENV] = "0"
    ensure_cpu_allocator_tuned()
    chosen = [resolve_precision(name, args.device) for name in args.precision.split(",")]
    if len(chosen) == 1 and args.precision == "auto" and chosen[0].reduced:
        chosen.insert(0, resolve_precision("fp32", args.device))  # auto's pick beside fp32
    model = load_any(args.model, args.num_labels).eval()
    adapter = get_adapter(model)
    config = adapter.encoder_config(model)
    heads = random_head_sets(
        args.members,
        adapter.num_layers(model),
        config.num_attention_heads,
        args.heads_per_layer,
        seed=args.seed,
        shared_layers=args.shared_layers,
    )
    generator = torch.Generator().manual_seed(args.seed)

    def make_inputs(batch: int) -> dict:
        if config.model_type in VISION_MODEL_TYPES:
            size = config.image_size
            return {"pixel_values": torch.randn(batch, config.num_channels, size, size, generator=generator)}
        low = min(1000, config.vocab_size // 2)  # skip special tokens of real vocabularies
        ids = torch.randint(low, config.vocab_size, (batch, args.tokens), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    setting = (
        f"{args.model}, M={args.members}, {args.heads_per_layer}/{config.num_attention_heads} heads per "
        f"layer (random, seed {args.seed}), {args.tokens} tokens, {args.repeats} interleaved runs, "
        f"device {args.device}"
        + (f", shared trunk of {args.shared_layers} layers" if args.shared_layers else "")
    )
    precision = "; ".join(str(p) for p in chosen)
    print(f"machine: {describe_machine()}\nsetting: {setting}\nprecision: {precision}")
    results = run_bench(
        model,
        heads,
        make_inputs,
        args.batch_sizes,
        [p.dtype_name for p in chosen],
        repeats=args.repeats,
        test_set=args.test_set,
        device=args.device,
        onnx=args.onnx,
    )
    mark_report_dir(out)
    atomic_write_json(
        out / "bench.json",
        {"machine": describe_machine(), "setting": setting, "precision": precision, **results},
    )
    table = bench_report(results, describe_machine(), f"{setting}; precision: {precision}")
    atomic_write_text(out / "bench.md", table)
    print(table)
    return 0


def precision_option(parser: argparse.ArgumentParser) -> None:
    from .precision import PRECISIONS

    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help=PRECISION_HELP)


class _DefaultsShown(argparse.HelpFormatter):
    """Help that states every option's default value (``None`` and off switches excepted)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default == argparse.SUPPRESS)
        shown = shown and not isinstance(default, list)
        if shown and action.option_strings and "%(default)" not in text and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (what is wrong, and where the help is) and every default
    shown in ``--help``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsShown)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        default = kwargs.get("default")
        if kwargs.get("help") is None and not (default is None or default is False):
            kwargs["help"] = "(default: %(default)s)"  # argparse shows nothing for an option without help
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _between(low: float, high: float):
    """An argparse type: a finite number strictly between ``low`` and ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low < value < high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in ({low}, {high}), got {text}")
        return value

    parse.__name__ = f"number in ({low}, {high})"
    return parse


_fraction, _positive_float = _between(0, 1), _between(0, float("inf"))
POSITIVE, COUNT = _at_least(1), _at_least(0)
MIN_RESAMPLES = 40
"""Fewest bootstrap resamples for a 95% interval: one resample in each 2.5% tail."""


def _positive_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers (``1,8,64``)."""
    values = [POSITIVE(item) for item in text.split(",")]
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def _device(text: str) -> str:
    """An argparse type: a device name (``cpu``, ``cuda``, ``cuda:1``); whether the machine has
    it is checked when the command starts."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: only cpu and cuda[:N] are supported")
    return text


def _resamples(text: str) -> int:
    """An argparse type: 0 (no bootstrap) or at least `MIN_RESAMPLES`."""
    value = COUNT(text)
    if 0 < value < MIN_RESAMPLES:
        raise argparse.ArgumentTypeError(
            f"a 95% interval needs at least {MIN_RESAMPLES} resamples (one in each 2.5% tail), got {value}; "
            "0 turns the bootstrap off"
        )
    return value


RANDOM_HEAD_HELP = (
    "accept a model whose classifier head is not trained (a base model: its head is initialised "
    "randomly from a fixed seed); without this, such a model is refused: fine-tune it first with "
    "hydra-ens finetune"
)


def _random_head_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-random-head", action="store_true", help=RANDOM_HEAD_HELP)


def _num_labels_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-labels", type=POSITIVE, help=NUM_LABELS_HELP)


def _overwrite_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace a finished result already in --out")


def _report_overwrite_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write the report into a folder holding files hydra-ens did not write (same names are replaced)",
    )


def _calibration_options(p: argparse.ArgumentParser, data: str) -> None:
    """The calibration a command fits on ``data`` and saves with the model it writes."""
    p.add_argument(
        "--flag-score",
        choices=OOD_SCORES,
        default="msp",
        help=f"OOD score the saved calibration flags on (higher = more likely OOD), fit on {data}",
    )
    p.add_argument(
        "--keep",
        type=_fraction,
        default=0.95,
        help=f"share of {data}'s inputs the saved flag threshold leaves unflagged",
    )


def _data_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that reads data: precision, columns, batch size, length."""
    precision_option(p)
    p.add_argument(
        "--text-column",
        help="text column (default: text; for a Hugging Face dataset, text or its only string column)",
    )
    p.add_argument(
        "--label-column",
        help="label column (default: label; for a Hugging Face dataset, label or its only ClassLabel)",
    )
    p.add_argument("--batch-size", type=POSITIVE, default=32)
    p.add_argument("--max-length", type=_at_least(2), default=128, help="tokens per text")


def _add_info_command(sub) -> None:
    info = sub.add_parser("info", help="show a model's family, layers and heads")
    info.add_argument(
        "model", nargs="?", default=DEFAULT_TEXT_MODEL, help="HF id, local directory or minilm-l6"
    )
    _num_labels_option(info)
    info.set_defaults(func=_cmd_info)


def _add_fuse_command(sub) -> None:
    fuse = sub.add_parser("fuse", help="fuse zero-shot members given as head-set JSON files")
    fuse.add_argument("model", help="HF id, local directory or minilm-l6")
    fuse.add_argument(
        "--heads",
        nargs="+",
        required=True,
        help="JSON files, each a head set {layer: [heads]} or a list of them",
    )
    _num_labels_option(fuse)
    fuse.add_argument("--out", required=True, help="output directory")
    _random_head_option(fuse)
    _overwrite_option(fuse)
    fuse.set_defaults(func=_cmd_fuse)


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


def _add_score_command(sub) -> None:
    score = sub.add_parser("score", help="rank heads: Taylor importance or greedy circuit extraction (JSON)")
    score.add_argument("model", help="a fine-tuned classifier: HF id or directory, or a saved member")
    score.add_argument("--method", choices=["taylor", "circuit"], default="circuit")
    score.add_argument(
        "--data",
        required=True,
        help="labelled ID validation/calibration data: a built-in name (bbc-news:val, ...) or a file",
    )
    score.add_argument("--ood-data", help="OOD *validation* data for --objective ood|avg (never a test set)")
    score.add_argument("--objective", choices=["acc", "ood", "avg"], default="avg")
    score.add_argument("--budget", type=POSITIVE, default=24, help="heads to remove (circuit)")
    score.add_argument("--min-heads-per-layer", type=COUNT, default=0)
    score.add_argument("--heads-per-layer", type=COUNT, default=8, help="heads kept per layer (taylor)")
    score.add_argument("--scope", choices=["layer", "global"], default="layer", help="taylor budget scope")
    score.add_argument("--limit", type=POSITIVE, help="use at most this many examples per dataset")
    score.add_argument(
        "--checkpoint", help="JSON file to resume an interrupted extraction (removed after success)"
    )
    score.add_argument("--keep-checkpoint", action="store_true", help="keep --checkpoint after success")
    score.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _random_head_option(score)
    score.add_argument(
        "--lazy",
        type=POSITIVE,
        metavar="K",
        help="approximate (lazy greedy) circuit extraction: score only the K best-known candidates "
        "per step between full refreshes (see benchmarks/circuit_speed.py for its agreement)",
    )
    score.add_argument(
        "--refresh-every", type=POSITIVE, default=8, help="--lazy: steps between full refreshes"
    )
    score.add_argument(
        "--cache-gb",
        type=float,
        default=2.0,
        help="memory cap for reusing hidden states across circuit steps (0: off; same result either way)",
    )
    _num_labels_option(score)
    score.add_argument("--out", required=True, help="output JSON file")
    _data_options(score)
    score.set_defaults(func=_cmd_score)


def _add_build_command(sub) -> None:
    build = sub.add_parser(
        "build", help="members from a ranking -> optional fine-tuning -> fused Hydra model"
    )
    build.add_argument("model", help="the model the ranking was computed on")
    build.add_argument("--scores", required=True, help="JSON written by hydra-ens score")
    build.add_argument("--members", type=POSITIVE, default=3)
    group = build.add_mutually_exclusive_group(required=True)
    group.add_argument("--heads-per-layer", type=COUNT, help="heads each member keeps per layer")
    group.add_argument("--num-pruned", type=COUNT, help="heads each member prunes in total")
    build.add_argument(
        "--pool-size",
        type=POSITIVE,
        help="the least useful heads each member samples its pruned heads from: per layer with "
        "--heads-per-layer, in the whole model with --num-pruned (default: twice the heads pruned, "
        "at most the heads the ranking ranks)",
    )
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--fine-tune", action="store_true", help="fine-tune every member on --data")
    build.add_argument("--data", help="labelled training data for --fine-tune")
    build.add_argument(
        "--val-data",
        help="labelled ID validation data: early stopping, and the calibration (temperature, OOD "
        "flag threshold) saved with the fused model and the members' ensemble",
    )
    build.add_argument("--epochs", type=POSITIVE, default=3)
    build.add_argument("--lr", type=_positive_float, default=5e-5)
    build.add_argument("--patience", type=POSITIVE)
    build.add_argument("--mlp", choices=["merge", "exact"], default="merge")
    _num_labels_option(build)
    build.add_argument("--out", required=True, help="output directory (hydra/, members/, checkpoints/)")
    build.add_argument(
        "--keep-checkpoints", action="store_true", help="keep the fine-tuning checkpoints after success"
    )
    build.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _calibration_options(build, "--val-data")
    _random_head_option(build)
    _overwrite_option(build)
    _data_options(build)
    build.set_defaults(func=_cmd_build)


def _add_finetune_command(sub) -> None:
    tune = sub.add_parser(
        "finetune",
        help="fine-tune a classifier (e.g. a base model's new head) on labelled data; save it with its "
        "preprocessor and class names (what score and build start from)",
    )
    tune.add_argument("model", help="HF id or directory (a base model gets a new head), or minilm-l6")
    tune.add_argument("--data", required=True, help="labelled training data")
    tune.add_argument(
        "--val-data",
        help="labelled ID validation data (reported; early stopping with --patience; the calibration "
        "saved with the model)",
    )
    tune.add_argument("--epochs", type=POSITIVE, default=3)
    tune.add_argument("--lr", type=_positive_float, default=5e-5)
    tune.add_argument("--patience", type=POSITIVE)
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument(
        "--train",
        default="attention,mlp,norm,head,embeddings",
        help="comma-separated parts to train: attention, mlp, norm, head, embeddings",
    )
    tune.add_argument("--num-labels", type=POSITIVE, help="classes (default: those of --data)")
    tune.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    tune.add_argument("--out", required=True, help="output model directory (a Hugging Face model)")
    tune.add_argument("--keep-checkpoints", action="store_true", help="keep OUT.checkpoint/ after success")
    _calibration_options(tune, "--val-data")
    _overwrite_option(tune)
    _data_options(tune)
    tune.set_defaults(func=_cmd_finetune, allow_random_head=True)


def _add_eval_command(sub) -> None:
    evaluate = sub.add_parser("eval", help="evaluate methods on ID, OOD (near/far) data; write a report")
    evaluate.add_argument(
        "--method",
        action="append",
        required=True,
        help="NAME=PATH[,PATH...]: a saved Hydra model, member or HF model; several = ensemble",
    )
    evaluate.add_argument("--id-data", required=True, help="labelled ID test data")
    evaluate.add_argument("--ood", action="append", help="NAME=SPEC:near|far (repeatable)")
    evaluate.add_argument("--val-data", help="labelled ID validation data: also report temperature scaling")
    evaluate.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    evaluate.add_argument("--limit", type=POSITIVE, help="at most this many examples per dataset")
    evaluate.add_argument(
        "--shift",
        action="store_true",
        help="also measure accuracy and Brier under corruptions at severities 1-5",
    )
    evaluate.add_argument("--shift-limit", type=POSITIVE, default=100, help="ID test examples corrupted")
    evaluate.add_argument(
        "--bootstrap",
        type=_resamples,
        default=0,
        help="bootstrap resamples (e.g. 1000) for 95%% intervals of every main metric and paired "
        "differences (with p-values) of every method from the first --method",
    )
    _random_head_option(evaluate)
    evaluate.add_argument("--out", required=True, help="report folder")
    _report_overwrite_option(evaluate)
    _data_options(evaluate)
    evaluate.set_defaults(func=_cmd_eval)


def _add_predict_command(sub) -> None:
    pred = sub.add_parser(
        "predict", help="per-input predictions with uncertainty and an OOD flag (CSV or JSON Lines)"
    )
    pred.add_argument(
        "model", help="PATH[,PATH...]: a saved Hydra model, member or HF model; several = ensemble"
    )
    pred.add_argument("--data", required=True, help="the inputs (unlabelled unless --labelled)")
    pred.add_argument("--labelled", action="store_true", help="the data has labels: add label and correct")
    pred.add_argument(
        "--val-data",
        help="labelled ID validation data: fit the temperature and the flag threshold on it instead "
        "of using the calibration saved with the model",
    )
    pred.add_argument(
        "--flag-score",
        choices=OOD_SCORES,
        help="OOD score to flag on, with --val-data (default: the saved calibration's, else msp)",
    )
    pred.add_argument(
        "--keep",
        type=_fraction,
        help="share of ID validation inputs left unflagged, with --val-data (default: the saved "
        "calibration's, else 0.95)",
    )
    _random_head_option(pred)
    pred.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    pred.add_argument("--out", required=True, help="output file: .csv or .jsonl")
    _data_options(pred)
    pred.set_defaults(func=_cmd_predict)


def _add_bench_command(sub) -> None:
    bench = sub.add_parser("bench", help="latency, parameters, multiply-adds and memory of every method")
    bench.add_argument("model", nargs="?", default=DEFAULT_TEXT_MODEL)
    bench.add_argument("--members", type=POSITIVE, default=3)
    bench.add_argument("--heads-per-layer", type=COUNT, default=8)
    bench.add_argument("--tokens", type=POSITIVE, default=128)
    bench.add_argument("--batch-sizes", type=_positive_list, default="1,8,64", help="comma-separated")
    bench.add_argument(
        "--precision",
        default="auto",
        help="precisions to time, comma-separated (fp32,bf16,fp16); auto: fp32, plus bf16/fp16 where "
        "auto picks it (see --precision of the other commands)",
    )
    bench.add_argument("--repeats", type=POSITIVE, default=10)
    bench.add_argument(
        "--test-set", type=COUNT, default=351, help="inputs in the whole-test-set timing (0: skip)"
    )
    bench.add_argument(
        "--device", type=_device, default="cpu", help="cpu or cuda[:N] (timed with CUDA synchronisation)"
    )
    bench.add_argument(
        "--shared-layers",
        type=COUNT,
        default=0,
        help="members share their first K layers' heads, which then run once (a shared trunk)",
    )
    bench.add_argument("--seed", type=int, default=0)
    _num_labels_option(bench)
    bench.add_argument(
        "--default-allocator",
        action="store_true",
        help="keep glibc's default allocator (the same as HYDRA_TUNE_ALLOCATOR=0)",
    )
    bench.add_argument("--out", default="runs/bench", help="report folder")
    _report_overwrite_option(bench)
    bench.add_argument(
        "--onnx",
        action="store_true",
        help="also time the fused model exported to ONNX and run by onnxruntime (float32, CPU)",
    )
    bench.set_defaults(func=_cmd_bench)


def _add_zero_shot_command(sub) -> None:
    zs = sub.add_parser(
        "zero-shot",
        help="zero-shot Hydra from a dual encoder (CLIP, or a sentence encoder): circuit over the "
        "heads of both towers -> members -> fused zero-shot model, no training",
    )
    zs.add_argument("model", help="a CLIPModel or a sentence-transformers checkpoint (HF id or directory)")
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
    _calibration_options(zs, "--data")
    _overwrite_option(zs)
    _data_options(zs)
    zs.set_defaults(func=_cmd_zero_shot)


def _add_demo_command(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="the paper's experiment on an embedded benchmark (text: MiniLM-L6 on BBC News; "
        "image: pretrained DINOv2-S fine-tuned on Fashion-MNIST)",
    )
    demo.add_argument(
        "--task",
        choices=["text", "image", "zero-shot"],
        default="text",
        help="text (default, about 5 minutes here), image (about 15 minutes here) or zero-shot "
        "(MiniLM-L6 as a dual encoder on BBC News topics, no training; about 3 minutes here)",
    )
    demo.add_argument(
        "--full",
        action="store_true",
        help="the larger protocol: all training data, longer inputs, fp32 evaluation (text and image: "
        "up to an hour here; zero-shot: all-mpnet-base-v2 on every test text, hours on 2 CPU cores)",
    )
    demo.add_argument(
        "--model",
        help=f"text: a BERT/RoBERTa/DistilBERT hub id or directory (default {DEFAULT_TEXT_MODEL}); "
        f"image: {DEFAULT_IMAGE_MODEL} (default; dinov2-s-<px> for another input size) or "
        "vit-6x12-p7 (a small ViT trained from scratch)",
    )
    seeds = demo.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="seed of the run (default: %(default)s)")
    seeds.add_argument(
        "--seeds",
        help="comma-separated seeds, e.g. 0,1,2: the demo once per seed (cached models are reused), "
        "then mean ± std over the seeds (seeds.md)",
    )
    demo.add_argument("--out", help="report folder (default runs/demo, image: runs/demo-image)")
    demo.add_argument("--cache-dir", default="runs/cache", help="cached models and rankings")
    demo.add_argument("--no-cache", action="store_true", help="recompute everything")
    demo.add_argument(
        "--trunk-study",
        action="store_true",
        help="also build Hydra with a shared trunk of L/3 and L/2 layers and compare",
    )
    demo.add_argument(
        "--batch-ensemble", action="store_true", help="also report a BatchEnsemble baseline (M members)"
    )
    demo.add_argument(
        "--packed",
        action="store_true",
        help="also report Packed-Ensembles (alpha=2 from scratch; alpha=M from the pretrained weights)",
    )
    demo.add_argument(
        "--mimo", action="store_true", help="also report MIMO (M inputs in one pass; rho 0.5, batch repeat 4)"
    )
    demo.add_argument(
        "--oba",
        action="store_true",
        help="also report OBA (unstructured, second-order), as many parameters as Taylor, fine-tuned",
    )
    demo.add_argument(
        "--wanda",
        action="store_true",
        help="also report Wanda (unstructured, |W| x input norm), as many parameters as Taylor, fine-tuned",
    )
    precision_option(demo)
    demo.set_defaults(func=_cmd_demo)


def _add_analyze_command(sub) -> None:
    from .analysis import STUDIES

    analyze = sub.add_parser(
        "analyze",
        help="the paper's analysis on the demo's models: Proposition 1's conditions, what heads "
        "represent, member count, merged vs exact MLPs (about 5 minutes here for text, demo cache warm)",
    )
    analyze.add_argument("--task", choices=["text", "image"], default="text")
    analyze.add_argument(
        "--studies",
        default=",".join(STUDIES),
        help=f"comma-separated, from {', '.join(STUDIES)} (default: all)",
    )
    analyze.add_argument("--out", help="report folder (default runs/analysis, image: runs/analysis-image)")
    analyze.add_argument("--cache-dir", default="runs/cache", help="the demo's cache (models are reused)")
    analyze.add_argument("--items", type=COUNT, default=64, help="ID validation items for Proposition 1")
    analyze.add_argument("--probes", type=COUNT, default=8, help="Hutchinson probes (at least 2)")
    analyze.add_argument("--max-members", type=COUNT, default=5, help="member-count study: M = 2 .. this")
    analyze.add_argument(
        "--bootstrap", type=_resamples, default=200, help="bootstrap resamples for intervals"
    )
    precision_option(analyze)
    analyze.set_defaults(func=_cmd_analyze)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hydra-ens",
        description="Hydra Ensembles: prune attention heads M ways, fuse the members into one model.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_info_command(sub)
    _add_fuse_command(sub)
    _add_score_command(sub)
    _add_build_command(sub)
    _add_finetune_command(sub)
    _add_eval_command(sub)
    _add_predict_command(sub)
    _add_bench_command(sub)
    _add_export_command(sub)
    _add_zero_shot_command(sub)
    _add_demo_command(sub)
    _add_analyze_command(sub)
    return parser


RESUME_HINTS = {
    "score": "rerun the same command with the same --checkpoint to resume",
    "build": "rerun the same command to resume (finished members and epochs are kept)",
    "finetune": "rerun the same command to resume from the last finished epoch",
}


def main(argv: list[str] | None = None) -> int:
    import warnings

    args = build_parser().parse_args(argv)
    with warnings.catch_warnings(), _sigterm_as_interrupt():
        warnings.showwarning = _show_warning  # one line each, like the errors
        return _run(args)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or container's stop) during a command: handled like Ctrl-C, with
    the same line on how to resume, and exit code 143."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """Turn SIGTERM into `Terminated` while a command runs (main thread only); the previous
    handler is restored afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"hydra-ens: warning: {_one_line(message)}", file=sys.stderr)


OWN_PRECISION_REPORT = ("bench", "demo", "analyze")
"""Commands that report their precision themselves (per setting, in their reports)."""


def _resolve_precision_once(args: argparse.Namespace) -> None:
    """``--precision`` resolved once, before any work: every step of the command computes in the
    same precision (``auto`` decides here), said with its reason when work begins (`_say_precision`),
    and recorded in what the commands write (``args.precision_reason``)."""
    from .precision import resolve_precision

    if getattr(args, "precision", None) is None or args.command in OWN_PRECISION_REPORT:
        return
    chosen = resolve_precision(args.precision, "cpu")
    args.precision, args.precision_reason = chosen.name, chosen.reason


def _say_precision(args: argparse.Namespace) -> None:
    """One line on stdout with the precision and why, once the inputs are checked and work begins
    (stderr keeps one line for a bad input)."""
    print(f"computing in {args.precision} ({args.precision_reason})")


INPUT_OPTIONS = (
    "model",
    "data",
    "val_data",
    "ood_data",
    "id_data",
    "scores",
    "heads",
    "preprocessor",
    "cache_dir",
)
OUTPUT_OPTIONS = {"out": "--out", "checkpoint": "--checkpoint"}


def _guard_outputs(args: argparse.Namespace) -> None:
    """The one output-path guard of every command: no output is, contains or lies inside an input
    (`io.check_outputs_apart`). Inputs: every path option, the paths in ``--method NAME=PATH,...``
    and ``--ood NAME=SPEC:near|far``; a comma-separated list of models is split."""
    from .io import check_outputs_apart

    inputs: list[str] = []
    for name in INPUT_OPTIONS:
        value = getattr(args, name, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                inputs += [item, *item.split(",")]
    for item in (getattr(args, "method", None) or []) if args.command == "eval" else []:
        inputs += item.partition("=")[2].split(",")
    for item in getattr(args, "ood", None) or []:
        inputs.append(item.partition("=")[2].rpartition(":")[0])
    outputs = {flag: getattr(args, name, None) for name, flag in OUTPUT_OPTIONS.items()}
    check_outputs_apart({flag: path for flag, path in outputs.items() if isinstance(path, str)}, inputs)


def _locked_outputs(args: argparse.Namespace) -> contextlib.ExitStack:
    """An exclusive lock on each output of the command (`io.output_lock`): a second process
    writing the same output is refused."""
    from .io import output_lock

    stack = contextlib.ExitStack()
    if args.command in ("demo", "analyze"):  # they lock their output folder, default included
        return stack
    try:
        for name in OUTPUT_OPTIONS:
            if isinstance(path := getattr(args, name, None), str):
                stack.enter_context(output_lock(path))
    except BaseException:
        stack.close()
        raise
    return stack


def _run(args: argparse.Namespace) -> int:
    try:
        _guard_outputs(args)
        with _locked_outputs(args):
            _resolve_precision_once(args)
            return args.func(args)
    except KeyboardInterrupt as exc:
        if args.command == "score" and not getattr(args, "checkpoint", None):
            hint = "nothing was written; pass --checkpoint FILE to make a rerun resumable"
        else:
            hint = RESUME_HINTS.get(args.command, "nothing was written; rerun the command")
        terminated = isinstance(exc, Terminated)
        print(f"hydra-ens: {'terminated' if terminated else 'interrupted'}; {hint}", file=sys.stderr)
        return 143 if terminated else 130
    except (MissingDataError, MissingModelError) as exc:
        print(f"hydra-ens: {exc}", file=sys.stderr)
        return 3
    except (ValueError, TypeError) as exc:  # typed errors of bad input (ModelNotFoundError, ...)
        print(f"hydra-ens: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written
        where = f" {exc.filename}" if exc.filename else ""
        print(f"hydra-ens: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException | Warning | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 600 else text[:597] + "..."


if __name__ == "__main__":
    sys.exit(main())
