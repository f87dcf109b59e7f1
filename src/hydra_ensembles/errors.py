"""Errors that refuse what a user gave: `InputError` (each module's own refusals subclass it) and
`UnsupportedModelError`; and the errors of a missing package (`MissingDataError`,
`MissingModelError`).

The command line ends a command in one line with exit 2 on an `InputError` or an
`UnsupportedModelError` (a refusal of the user's input); any other exception, a plain
`ValueError` or `TypeError` raised inside a computation included, is a bug and is reported as an
internal error (exit 1, the traceback with ``HYDRA_DEBUG=1``)."""

from __future__ import annotations


class UnsupportedModelError(TypeError):
    """The model's architecture has no adapter, or a part of it cannot be pruned or fused."""


class InputError(ValueError):
    """A refusal of what the user gave (data, a model, a setting, a saved file): the message says
    what is wrong and how to fix it. Every module's own refusals (`HeadSetError`, `ExportError`,
    ...) are InputErrors; a plain `ValueError` from inside a computation is not, and the command
    line reports it as an internal error."""


class MissingDataError(RuntimeError):
    """A data package is not installed; the message says how to install it."""


class MissingModelError(RuntimeError):
    """The embedded default model's package is not installed."""
