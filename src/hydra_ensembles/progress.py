"""Progress bars that never leave a long step silent.

In a terminal a bar is live; where stderr is not a terminal (a log file, a job scheduler, a
notebook's captured output) a bar appears only once its step has run for `QUIET_DELAY` seconds
and is then updated every `QUIET_DELAY` seconds, so a long step leaves a line in the log every
half minute and a short one none."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

QUIET_DELAY = 30.0


def progress_bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (or of ``total=`` steps), off where not ``enabled``."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", QUIET_DELAY)
        kwargs.setdefault("delay", QUIET_DELAY)
    return tqdm(iterable, disable=not enabled, **kwargs)
