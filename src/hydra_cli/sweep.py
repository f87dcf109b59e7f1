"""``hydra-ens sweep``: a grid of Hydra builds beside the single model, measured on the user's own
held-out validation data and timed side by side; the cost/quality frontier; ``--budget`` saves the
best configuration within a latency ratio."""

from __future__ import annotations

import argparse
import sys

from hydra_ensembles.errors import InputError
from hydra_ensembles.saving.files import RUN_MARKER

from .build import member_training_options, settings_key, start_building
from .command import Command
from .common import _data_batches, _record_length, _resolve_epochs
from .options import (
    POSITIVE,
    PREPROCESSOR_HELP,
    _calibration_options,
    _data_options,
    _overwrite_option,
    _random_head_option,
    _training_options,
    calibration_config,
    int_list,
    share_list,
)

FINISHED = "sweep.json"
PUBLISHED = ("sweep.csv", "sweep.md", "frontier.png")
"""The sweep's report files, written before `FINISHED` (the marker of a finished sweep) and
removed with it when a finished sweep is timed and chosen again."""
WRITTEN = ("configs", "chosen", *PUBLISHED)
OWNED = (*WRITTEN, FINISHED, RUN_MARKER)
UNSETTING = (
    *("out", "overwrite", "repeats", "batch_sizes", "budget", "prefer"),
    *("members", "num_pruned", "shared_layers", "keep_base", "mlp_keep", "lora_rank", "compare"),
)
"""Options that change no finished candidate's model or measures (what each candidate is made
of is checked on its own: `sweep.run.identity`): a rerun that differs only in them resumes, or
reuses a finished sweep's candidates, makes the new ones, and times and chooses again."""
HALVES = {"fit": 0.5, "held": 0.5}
"""Each validation set's halves: one fits every calibration, the other measures."""


def _ratio(text: str) -> float:
    """A latency ratio to the single model: a finite number >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"a latency ratio to the single model is a finite number >= 1, got {text} (to choose whatever "
            "the cost, give a ratio above every candidate's, e.g. 100)"
        )
    return value


def _halves(spec: str, args: argparse.Namespace, preprocessor, model, labels: bool) -> tuple[list, list]:
    """The data ``spec`` names, split in two by a stable hash of each example's id (the same split
    on every run), as batches: (fit half, held-out half)."""
    from hydra_ensembles.data import load_spec, split_indices

    dataset = load_spec(spec, args.text_column, args.label_column, labelled=labels)
    parts = split_indices(dataset.ids, HALVES, salt="sweep")
    if min(len(p) for p in parts.values()) < 2:
        raise InputError(
            f"{spec}: {len(dataset)} examples are too few to split into a fit and a held-out half"
        )
    return tuple(  # type: ignore[return-value]
        _data_batches(spec, args, preprocessor, labels=labels, model=model, dataset=dataset.subset(parts[h]))[
            1
        ]
        for h in HALVES
    )


def _compared(args: argparse.Namespace, preprocessor) -> dict:
    """``--compare NAME=PATH[,PATH...]``: each named model (several paths: their deep ensemble),
    refused in one line where it reads its inputs otherwise than the sweep's model (its classes
    are checked with every other option: `sweep.check_sweep`)."""
    from hydra_ensembles.loading import preprocessing_signature

    from .common import _load_methods

    compared = {}
    for item in args.compare or []:
        name, sep, paths = item.partition("=")
        if not (name and sep and paths):
            raise InputError(f"--compare wants NAME=PATH[,PATH...], got {item!r}")
        if name in compared:
            raise InputError(f"--compare names {name!r} twice: give every model its own name")
        models, theirs = _load_methods(paths, args)
        if theirs is not None and preprocessing_signature(theirs) != preprocessing_signature(preprocessor):
            raise InputError(f"--compare {name}: its tokenizer or image processor is not the sweep model's")
        compared[name] = models if len(models) > 1 else models[0]
    return compared


def _compare_paths(args: argparse.Namespace) -> list[str]:
    """The paths in ``--compare NAME=PATH[,PATH...]`` (inputs the output guard must see)."""
    return [path for item in args.compare or [] for path in item.partition("=")[2].split(",")]


def _sweep_data(args: argparse.Namespace, preprocessor, model):
    from hydra_ensembles.data.labels import check_trainable
    from hydra_ensembles.sweep import SweepData

    train = None
    if args.data:
        dataset, train = _data_batches(args.data, args, preprocessor, model=model)
        check_trainable(dataset.labels, dataset.classes, args.data)
    fit, held = _halves(args.val_data, args, preprocessor, model, labels=True)
    ood_fit = ood_held = None
    if args.ood_data:
        ood_fit, ood_held = _halves(args.ood_data, args, preprocessor, model, labels=False)
    return SweepData(train, fit, held, ood_fit, ood_held)


def _sweep_config(args: argparse.Namespace, train):
    from hydra_ensembles.sweep import SweepConfig
    from hydra_ensembles.training import FineTuneConfig

    tuning = None
    if args.fine_tune:
        tuning = FineTuneConfig(
            epochs=_resolve_epochs(args, train), lr=args.lr, seed=args.seed, patience=args.patience
        )
    return SweepConfig(
        members=args.members,
        num_pruned=args.num_pruned,
        shared_layers=args.shared_layers,
        keep_base=(False, True) if args.keep_base else (False,),
        mlp_keep=args.mlp_keep,
        fine_tune=tuning,
        bootstrap=args.bootstrap,
        seed=args.seed,
        calibration=calibration_config(args),
        precision=args.precision,
        batch_sizes=args.batch_sizes,
        repeats=args.repeats,
        budget=args.budget,
        lora_rank=args.lora_rank,
        prefer=args.prefer,
    )


def _cmd_sweep(args: argparse.Namespace) -> int:
    from hydra_ensembles.saving.files import claim_run_dir, recorded_run, replace_dir
    from hydra_ensembles.sweep import check_sweep, run_sweep

    from .guards import check_output_dir, overwrite_staging

    key = settings_key(args, UNSETTING)
    again = not args.overwrite and recorded_run(args.out) == key  # the same sweep: timed and chosen anew
    finished = None if again else FINISHED
    target = check_output_dir(args.out, finished=finished, resumable=OWNED, overwrite=args.overwrite)
    out = overwrite_staging(target, FINISHED, OWNED) if args.overwrite else target
    model, ranking, preprocessor = start_building(args)
    data = _sweep_data(args, preprocessor, model)
    compared = _compared(args, preprocessor)
    _record_length(model, args)
    config = _sweep_config(args, data.train)
    check_sweep(model, ranking, data, config, compared)  # every option against the model, before any work
    with claim_run_dir(out, key, WRITTEN, restart=args.overwrite, beside=out != target):
        if again:  # unfinished until the new timing and choice are written, all of them together
            for name in (FINISHED, *PUBLISHED):
                (out / name).unlink(missing_ok=True)
        result = run_sweep(
            model,
            ranking,
            data,
            config,
            out,
            preprocessor=preprocessor,
            log=lambda line: print(line, file=sys.stderr),
            compare=compared,
        )
        _write_results(out, result, config, args)
    if out != target:
        replace_dir(target, out)
    print((target / "sweep.md").read_text())
    return 0


def _write_results(out, result, config, args: argparse.Namespace) -> None:
    """sweep.csv (every measure), sweep.md (the table and how it was made), frontier.png, and
    sweep.json last (the marker of a finished sweep)."""
    from hydra_ensembles import reporting
    from hydra_ensembles.runtime import describe_machine
    from hydra_ensembles.saving.files import atomic_write_json, atomic_write_records, atomic_write_text
    from hydra_ensembles.sweep import quality_key

    rows, chosen = result.rows, result.chosen
    machine = describe_machine()
    from hydra_ensembles.sweep import frontier

    panels = [("auroc", "flag's OOD AUROC (held out)")] if quality_key(rows)[0] == "auroc" else []
    panels.append(("nll", "NLL (held out, as served)"))
    reporting.frontier_plot(
        rows,
        out / "frontier.png",
        [(key, label, frontier(rows, quality=key)) for key, label in panels],
        config.budget,
        chosen,
        title=f"hydra-ens sweep on {args.val_data}; {machine}",
    )
    atomic_write_records(out / "sweep.csv", rows)
    atomic_write_text(out / "sweep.md", _markdown(rows, chosen, config, args, machine, result.verdict))
    atomic_write_json(
        out / FINISHED, {"rows": rows, "chosen": chosen, "machine": machine, "budget": config.budget}
    )


COLUMNS = (
    ("GMACs/input", "gmacs_per_input", ".3g"),
    ("weights MB", "weights_mb", ".1f"),
    ("acc", "acc", ".3f"),
    ("NLL", "nll", ".3f"),
    ("NLL (T=1)", "nll_t1", ".3f"),
    ("ECE", "ece", ".3f"),
    ("flag", "flag_score", "s"),
    ("AUROC", "auroc", ".3f"),
    ("FPR95", "fpr95", ".3f"),
    ("ID flagged", "id_flagged", ".3f"),
    ("set size", "set_size", ".2f"),
    ("disagreement", "disagreement", ".3f"),
    ("score spread", "member_score_spread", ".2f"),
)
"""The table's columns after the latency ratios: (header, row key, format)."""


def _table(rows, chosen, sizes) -> str:
    from hydra_ensembles.reporting import markdown_table

    differences = [m for m in ("auroc", "nll") if f"{m}_vs_single" in rows[0]]
    headers = [
        "configuration",
        "frontier",
        *[f"latency x{b}" for b in sizes],
        *[f"{m.upper()} - single [95%]" for m in differences],
        *[h for h, _, _ in COLUMNS],
    ]
    table = [
        [
            r["name"] + (" (chosen)" if i == chosen else ""),
            "yes" if r["frontier"] else "",
            *[f"{r[f'latency_ratio@{b}']:.2f}" for b in sizes],
            *[_difference(r, m) for m in differences],
            *["" if r.get(key) is None else format(r[key], style) for _, key, style in COLUMNS],
        ]
        for i, r in enumerate(rows)
    ]
    return markdown_table(headers, table)


def _difference(row, metric: str) -> str:
    """``row``'s paired difference from the single model with its interval, e.g. ``+0.012 [-0.003,
    +0.026]`` (empty for the single model itself)."""
    key = f"{metric}_vs_single"
    if row[key + "_low"] == row[key + "_high"] == 0:  # the single model itself
        return ""
    return f"{row[key]:+.3f} [{row[key + '_low']:+.3f}, {row[key + '_high']:+.3f}]"


def _markdown(rows, chosen, config, args: argparse.Namespace, machine: str, verdict: str = "") -> str:
    sizes = sorted(config.batch_sizes)
    lines = [
        "# hydra-ens sweep",
        "",
        f"- **data**: training {args.data or 'none'}; ID validation {args.val_data} (one half fits every "
        "calibration, the other half measures)"
        + (f"; OOD validation {args.ood_data} (halved alike)" if args.ood_data else ""),
        f"- **machine**: {machine}; precision {args.precision}",
        f"- **latency**: median of {config.repeats} interleaved rounds per batch size, as a ratio to "
        f"`single` in the same loop; the frontier ranks by the ratio at batch {sizes[-1]}",
        "- **measures**: on the held-out halves, as each model is served (its saved temperature, flag "
        "and sets); NLL (T=1): at temperature 1; `- single`: the paired difference from the single "
        "model on the same inputs, with its 95% bootstrap interval (1,000 resamples); disagreement: "
        "the share of held-out inputs on which two members' top classes differ (mean over pairs); "
        "score spread: the members' spread of the flag's feature score per input over its spread "
        "across inputs",
        "",
        _table(rows, chosen, sizes),
        "",
    ]
    if chosen is not None:
        lines.append(
            f"Chosen within {config.budget:g}x: `{rows[chosen]['name']}`, saved to chosen/ ({verdict})."
        )
    return "\n".join(lines) + "\n"


def _grid_options(sweep: argparse.ArgumentParser) -> None:
    """The grid's options: every combination is one candidate build."""
    sweep.add_argument("--members", type=int_list(2), default=(2, 3), help="members, e.g. 2,3 (default: 2,3)")
    sweep.add_argument(
        "--num-pruned",
        type=int_list(0),
        required=True,
        help="heads each member prunes, e.g. 4,8; 0: the fused deep ensemble of fine-tunes (every head "
        "kept; with --fine-tune) as a candidate too",
    )
    sweep.add_argument(
        "--shared-layers", type=int_list(0), default=(0,), help="trunk depths to try, e.g. 0,2 (default: 0)"
    )
    sweep.add_argument(
        "--keep-base", action="store_true", help="also try each build with the model itself as member 1"
    )
    sweep.add_argument(
        "--mlp-keep",
        type=share_list,
        default=(1.0,),
        help="shares of each layer's MLP neurons the members keep, to try, e.g. 1,0.5 (default: 1)",
    )
    sweep.add_argument(
        "--lora-rank",
        type=POSITIVE,
        help="also the fused LoRA-Ensemble of each member count as a candidate (lora-m<M>-r<R>): members "
        "fine-tune LoRA adapters of this rank on W_Q and W_V, merged; with --fine-tune (needs the "
        "baselines extra: peft)",
    )


def _add_sweep_arguments(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument("model", help="the model the ranking was computed on (the single model)")
    sweep.add_argument("--scores", required=True, help="JSON written by hydra-ens score")
    _grid_options(sweep)
    member_training_options(sweep)
    sweep.add_argument(
        "--compare",
        action="append",
        metavar="NAME=PATH[,PATH...]",
        help="a model to weigh beside the configurations as it is (several paths: their deep "
        "ensemble), calibrated and measured like them; repeatable",
    )
    sweep.add_argument(
        "--data", help="labelled training data: for --fine-tune and the feature scores' statistics"
    )
    sweep.add_argument(
        "--val-data",
        required=True,
        help="labelled ID validation data: half fits every calibration, half measures every configuration",
    )
    _training_options(sweep)
    sweep.add_argument(
        "--batch-sizes", type=int_list(1), default=(1, 64), help="timed batch sizes (default: 1,64)"
    )
    sweep.add_argument("--repeats", type=POSITIVE, default=5, help="interleaved timing rounds")
    sweep.add_argument(
        "--budget",
        type=_ratio,
        help="save to OUT/chosen the best configuration whose latency is at most this times the single "
        "model's (at the largest batch size) and that is significantly better than it (--prefer), else "
        "the single model",
    )
    sweep.add_argument(
        "--prefer",
        choices=("auroc", "nll"),
        help="the measure a candidate must be significantly better on (paired 95%% interval) to replace "
        "the single model, while significantly worse on no other (default: auroc with --ood-data, else nll)",
    )
    sweep.add_argument(
        "--out", required=True, help="output directory (configs/, sweep.md, frontier.png, chosen/)"
    )
    sweep.add_argument("--tokenizer", "--preprocessor", dest="preprocessor", help=PREPROCESSOR_HELP)
    _calibration_options(sweep, "the validation data's fit half")
    _random_head_option(sweep)
    _overwrite_option(sweep)
    _data_options(sweep)


COMMAND = Command(
    "sweep",
    help="many Hydra configurations beside the single model on your data: cost/quality frontier, "
    "and the best within a latency budget",
    add_arguments=_add_sweep_arguments,
    run=_cmd_sweep,
    resume="rerun the same command to resume (finished configurations are kept)",
    extra_inputs=_compare_paths,
)
