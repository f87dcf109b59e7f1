"""Errors that refuse what a user gave, beside the `ValueError` subclasses of each module.

The command line ends a command in one line with exit 2 on a `ValueError` or an
`UnsupportedModelError` (a refusal of the user's input); any other exception is a bug and is
reported as an internal error (exit 1, the traceback with ``HYDRA_DEBUG=1``)."""

from __future__ import annotations


class UnsupportedModelError(TypeError):
    """The model's architecture has no adapter, or a part of it cannot be pruned or fused."""
