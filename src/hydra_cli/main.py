"""The ``hydra-ens`` entry point: the parser of every command, and how a command runs (output
guards, locks, interruption, one-line errors)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from hydra_ensembles.errors import InputError, MissingDataError, MissingModelError, UnsupportedModelError

from . import (
    analyze,
    bench,
    build,
    calibrate,
    demo,
    evaluate,
    export,
    finetune,
    fuse,
    info,
    predict,
    score,
    serve,
    sweep,
    zero_shot,
)
from .command import Command
from .options import registered_scores

COMMANDS: tuple[Command, ...] = tuple(
    module.COMMAND
    for module in (
        info,
        fuse,
        score,
        build,
        sweep,
        calibrate,
        finetune,
        evaluate,
        predict,
        bench,
        export,
        serve,
        zero_shot,
        demo,
        analyze,
    )
)
"""Every subcommand, in the order ``hydra-ens --help`` lists them."""


class _DefaultsShown(argparse.HelpFormatter):
    """Help that states every option's default value (``None`` and off switches excepted)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = registered_scores(action.help or "")
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


class _CommandParser(_Parser):
    """A subcommand's parser, whose arguments are added (`Command.add_arguments`) the first time it
    parses or shows its help: ``hydra-ens --help`` and a mistyped command import nothing of any
    command, and a command imports only what its own options need."""

    def __init__(self, *args, command: Command, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command, self._complete = command, False
        self.set_defaults(record=command)

    def complete(self) -> _CommandParser:
        """Add the command's arguments (once); returns the parser."""
        if not self._complete:
            self._complete = True
            self.command.add_arguments(self)
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.complete()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (each command's arguments are added when it is used, see
    `_CommandParser`)."""
    parser = _Parser(
        prog="hydra-ens",
        description="Hydra Ensembles: prune attention heads M ways, fuse the members into one model.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for command in COMMANDS:
        described = {} if command.description is None else {"description": command.description}
        sub.add_parser(command.name, help=command.help, command=command, **described)
    return parser


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


def _resolve_precision_once(args: argparse.Namespace) -> None:
    """``--precision`` resolved once, before any work: every step of the command computes in the
    same precision (``auto`` decides here), said with its reason when work begins (`_say_precision`),
    and recorded in what the commands write (``args.precision_reason``)."""
    from hydra_ensembles.precision import resolve_precision

    if getattr(args, "precision", None) is None or args.record.reports_precision:
        return
    chosen = resolve_precision(args.precision, "cpu")
    # what was asked, for work done on other machines, which resolve ``auto`` themselves
    args.precision_asked = args.precision
    args.precision, args.precision_reason = chosen.name, chosen.reason


INPUT_OPTIONS = (
    "model",
    "data",
    "val_data",
    "ood_data",
    "id_data",
    "train_data",
    "ood_val",
    "scores",
    "heads",
    "preprocessor",
    "cache_dir",
)
OUTPUT_OPTIONS = {"out": "--out", "checkpoint": "--checkpoint", "plot": "--plot"}


def _guard_outputs(args: argparse.Namespace) -> None:
    """The one output-path guard of every command: no output is, contains or lies inside an input
    (`guards.check_outputs_apart`). Inputs: every path option, the paths in ``--method NAME=PATH,...``
    and ``--ood NAME=SPEC:near|far``; a comma-separated list of models is split."""
    from .guards import check_outputs_apart

    inputs: list[str] = []
    for name in INPUT_OPTIONS:
        value = getattr(args, name, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                inputs += [item, *item.split(",")]
    if args.record.extra_inputs is not None:
        inputs += args.record.extra_inputs(args)
    for item in getattr(args, "ood", None) or []:
        inputs.append(item.partition("=")[2].rpartition(":")[0])
    outputs = {flag: getattr(args, name, None) for name, flag in OUTPUT_OPTIONS.items()}
    check_outputs_apart({flag: path for flag, path in outputs.items() if isinstance(path, str)}, inputs)


def _locked_outputs(args: argparse.Namespace) -> contextlib.ExitStack:
    """An exclusive lock on each output of the command (`guards.output_lock`): a second process
    writing the same output is refused."""
    from .guards import output_lock

    stack = contextlib.ExitStack()
    if not args.record.locks_outputs:  # it locks its output folder itself, default included
        return stack
    try:
        for name in OUTPUT_OPTIONS:
            if isinstance(path := getattr(args, name, None), str):
                stack.enter_context(output_lock(path))
    except BaseException:
        stack.close()
        raise
    return stack


DEBUG_VARIABLE = "HYDRA_DEBUG"
"""Set to 1, an internal error shows its traceback."""


def _register_demo_sources() -> None:
    """The demos' named data and models (dinov2-s-<px>, all-mpnet-base-v2, ...), for every command;
    imported when a command runs, not for ``--help`` or an argument error."""
    import hydra_experiments.datasets
    import hydra_experiments.pretrained  # noqa: F401


def _run(args: argparse.Namespace) -> int:
    try:
        _register_demo_sources()
        _guard_outputs(args)
        with _locked_outputs(args):
            _resolve_precision_once(args)
            return args.record.run(args)
    except KeyboardInterrupt as exc:
        hint = args.record.resume_hint(args)
        terminated = isinstance(exc, Terminated)
        print(f"hydra-ens: {'terminated' if terminated else 'interrupted'}; {hint}", file=sys.stderr)
        return 143 if terminated else 130
    except (MissingDataError, MissingModelError) as exc:
        print(f"hydra-ens: {exc}", file=sys.stderr)
        return 3
    except (InputError, UnsupportedModelError) as exc:  # refusals of the input (ModelNotFoundError, ...)
        print(f"hydra-ens: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file that cannot be read or written
        where = f" {exc.filename}" if exc.filename else ""
        print(f"hydra-ens: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug (or a resource limit), never called bad input
        if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        print(
            f"hydra-ens: internal error: {type(exc).__name__}: {_one_line(exc)} ({DEBUG_VARIABLE}=1 shows "
            "the traceback; unless it is a resource limit such as memory, it is a bug: please report it)",
            file=sys.stderr,
        )
        return 1


def _one_line(exc: BaseException | Warning | str) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 600 else text[:597] + "..."


if __name__ == "__main__":
    sys.exit(main())
