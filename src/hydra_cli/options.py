"""Options and argument types shared by several commands."""

from __future__ import annotations

import argparse

PREPROCESSOR_HELP = (
    "a model directory or hub id to load the tokenizer (text) or image processor (images) from, "
    "instead of the one saved with the model (build and finetune save it beside every model they write)"
)
NUM_LABELS_HELP = "classes of a freshly initialised head (default: the saved head; 2 where none is saved)"
PRECISION_HELP = (
    "compute precision: auto (default) picks bf16 only where this machine computes it natively and "
    "measurably faster (a CPU with AMX or AVX-512 BF16, confirmed by a small timed probe; a GPU "
    "with bf16, else fp16) and fp32 otherwise (e.g. AVX2-only CPUs, where bf16 is emulated and far "
    "slower); fp32, bf16 or fp16 force one. HYDRA_PRECISION=fp32|bf16|fp16 sets what auto picks"
)


def ood_score(text: str) -> str:
    """``--flag-score``'s value: a score registered when the command runs (`ood.registry`: the
    built-in ones and those of installed packages)."""
    from hydra_ensembles.evaluation import ood_score_names

    if text not in ood_score_names():
        names = ", ".join(ood_score_names())
        raise argparse.ArgumentTypeError(f"unknown OOD score {text!r}; choose from {names}")
    return text


def ood_score_or_auto(text: str) -> str:
    """`ood_score`, or ``auto`` (the flag rule of docs/ood.md chooses)."""
    return text if text == "auto" else ood_score(text)


REGISTERED_SCORES = "<the registered OOD scores>"
"""Stands in a help text for the scores registered when the help is shown (`registered_scores`):
the registry is imported for ``--help`` only, never to parse arguments that do not name a score."""


def registered_scores(text: str) -> str:
    """``text`` with `REGISTERED_SCORES` spelled out: the logit scores, then the feature scores."""
    if REGISTERED_SCORES not in text:
        return text
    from hydra_ensembles.ood import feature_scores, logit_scores

    names = f"the logit scores {', '.join(logit_scores())}; the feature scores {', '.join(feature_scores())}"
    return text.replace(REGISTERED_SCORES, names)


def precision_option(parser: argparse.ArgumentParser) -> None:
    from hydra_ensembles.precision import PRECISIONS

    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help=PRECISION_HELP)


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


def _between(low: float, high: float, high_included: bool = False):
    """An argparse type: a finite number strictly above ``low`` and below ``high`` (or at it,
    ``high_included``)."""
    bracket = "]" if high_included else ")"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value <= high if high_included else low < value < high):  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in ({low}, {high}{bracket}, got {text}")
        return value

    parse.__name__ = f"number in ({low}, {high}{bracket}"
    return parse


_fraction, _positive_float = _between(0, 1), _between(0, float("inf"))
POSITIVE, COUNT = _at_least(1), _at_least(0)


def int_list(minimum: int):
    """An argparse type: comma-separated whole numbers, each at least ``minimum`` (``1,8,64``)."""
    item = _at_least(minimum)

    def parse(text: str) -> tuple[int, ...]:
        return tuple(item(value) for value in text.split(","))

    parse.__name__ = f"comma-separated integers >= {minimum}"
    return parse


share = _between(0, 1, high_included=True)
"""An argparse type: a share of a whole, in (0, 1] (1: all of it)."""


def share_list(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated shares, each in (0, 1] (``1,0.5``)."""
    return tuple(share(value) for value in text.split(","))


MIN_RESAMPLES = 40
"""Fewest bootstrap resamples for a 95% interval: one resample in each 2.5% tail."""


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


def _epochs(text: str) -> int | str:
    """``auto`` or a positive number of epochs."""
    return "auto" if text == "auto" else POSITIVE(text)


def _training_options(p: argparse.ArgumentParser) -> None:
    """Epochs, learning rate and early stopping of fine-tuning (`training.FineTuneConfig`)."""
    p.add_argument(
        "--epochs",
        type=_epochs,
        default="auto",
        help="epochs of fine-tuning; auto: 3, or on small data as many as give at least 100 "
        "optimizer steps (at most 20)",
    )
    p.add_argument("--lr", type=_positive_float, default=5e-5)
    p.add_argument(
        "--patience", type=POSITIVE, help="stop after this many epochs without a better --val-data NLL"
    )


def _calibration_options(p: argparse.ArgumentParser, data: str, ood_option: bool = True) -> None:
    """The calibration a command fits on ``data`` and saves with the model it writes (with
    ``ood_option``, an ``--ood-data`` option for the flag score's choice); the defaults are the
    library's (`CalibrationConfig`)."""
    from hydra_ensembles.calibration.settings import FLAG_METHODS, SET_METHODS, CalibrationConfig

    default = CalibrationConfig()
    p.add_argument(
        "--flag-score",
        type=ood_score_or_auto,
        metavar="SCORE",
        default=default.score,
        help=f"OOD score the saved calibration flags on (higher = more likely OOD), its threshold fit "
        f"on {data}: {REGISTERED_SCORES} (these read statistics of the members' features on "
        "--data), and any an installed package registers (docs/ood.md). auto: with --ood-data, the "
        "score separating it best from the ID validation data; without, mds where --data is given, "
        "else msp (docs/ood.md)",
    )
    if ood_option:
        p.add_argument(
            "--ood-data",
            help="unlabelled OOD validation data (never test data): --flag-score auto picks the score on it",
        )
    p.add_argument(
        "--keep",
        type=_fraction,
        default=default.keep,
        help=f"1 - the flag's level: with --flag-method conformal, at most 1 - KEEP of ID inputs like "
        f"{data}'s are flagged (in expectation); with quantile, the share of {data}'s inputs left unflagged",
    )
    p.add_argument(
        "--sets",
        choices=(*SET_METHODS, "none"),
        default=default.set_method or "none",
        help=f"conformal prediction sets saved with the calibration, fit on half of {data} (the other "
        "half fits the temperature): each input's set holds its true class with probability >= "
        "1 - --set-alpha (docs/ood.md)",
    )
    p.add_argument(
        "--set-alpha", type=_fraction, default=default.set_alpha, help="the prediction sets' level"
    )
    p.add_argument(
        "--set-classwise",
        action="store_true",
        default=default.set_classwise,
        help="class-conditional (Mondrian) sets: the coverage holds for every class, each class's "
        "quantile fit on its own validation inputs",
    )
    p.add_argument(
        "--flag-method",
        choices=FLAG_METHODS,
        default=default.flag_method,
        help="conformal: the threshold with the (n+1) correction, a bounded false-flag rate and a "
        "p-value per input (docs/ood.md); quantile: the plain empirical quantile",
    )


def calibration_config(args: argparse.Namespace):
    """The `CalibrationConfig` the options of `_calibration_options` ask for."""
    from hydra_ensembles.calibration.settings import CalibrationConfig

    return CalibrationConfig(
        score=args.flag_score,
        keep=args.keep,
        flag_method=args.flag_method,
        set_method="" if args.sets == "none" else args.sets,
        set_alpha=args.set_alpha,
        set_classwise=args.set_classwise,
    )


def _data_options(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """Options of every command that reads data: precision (where it computes in PyTorch),
    columns, batch size, length."""
    if precision:
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
    p.add_argument(
        "--max-length",
        type=_at_least(2),
        help="tokens per text (default: the length the model was trained and calibrated at, which "
        "finetune and build save with it; else 128)",
    )
