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


class _LoggedBar(tqdm):
    """A bar for a log: an explicit refresh (a new total, a postfix) waits for the delay too."""

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        delay = getattr(self, "delay", 0)  # a disabled bar has no settings
        if delay and not self.disable and self._time() - self.start_t < delay:
            return None
        return super().refresh(*args, **kwargs)


def progress_bar(iterable: Any = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar over ``iterable`` (or of ``total=`` steps), off where not ``enabled``."""
    if sys.stderr.isatty():
        return tqdm(iterable, disable=not enabled, **kwargs)
    kwargs.setdefault("mininterval", QUIET_DELAY)
    kwargs.setdefault("delay", QUIET_DELAY)
    return _LoggedBar(iterable, disable=not enabled, **kwargs)
