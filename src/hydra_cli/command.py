"""One record per ``hydra-ens`` subcommand: its name and help, its arguments, its handler, and
what the runner in `main` needs to know about it (whether it locks its outputs itself, how a
rerun resumes it, whether it reports its precision itself, which inputs hide inside its options)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    """The line ``hydra-ens --help`` lists the command with."""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    """Adds the command's arguments to its parser; called only when the command is parsed or its
    help shown, so that what they import (registries, defaults) costs nothing to other commands."""
    run: Callable[[argparse.Namespace], int]
    """The handler: does the work and returns the exit code."""
    description: str | None = None
    """The paragraph above the command's own ``--help`` (none: the help line is not repeated)."""
    locks_outputs: bool = True
    """False where the command locks its own output folder (its default included)."""
    resume: str | Callable[[argparse.Namespace], str] | None = None
    """What to say after an interruption about rerunning (None: nothing was written)."""
    reports_precision: bool = False
    """The command reports the precision of each setting itself, so `main` resolves none."""
    extra_inputs: Callable[[argparse.Namespace], list[str]] | None = None
    """Input paths inside option values (``--method NAME=PATH``) that the output guard must see."""

    def resume_hint(self, args: argparse.Namespace) -> str:
        hint = self.resume(args) if callable(self.resume) else self.resume
        return hint or "nothing was written; rerun the command"
