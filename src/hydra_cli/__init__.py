"""The ``hydra-ens`` command line."""

from . import clock  # noqa: F401  (first: a command's time counts the imports that follow)
from .main import build_parser, main

__all__ = ["build_parser", "main"]
