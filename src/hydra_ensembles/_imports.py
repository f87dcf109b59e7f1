"""Imports on demand: a package's public names loaded on first use (`lazy_exports`), code run
when a module is imported (`after_import`) or a class is first used (`on_first_use`). The library
registers itself with transformers this way, without importing transformers (and torch) when the
library is imported."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook`` once the module ``name`` has been imported (its code executed)."""

    def __init__(self, name: str, hook: Callable[[], None]) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the other finders locate the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, hook = spec.loader.exec_module, self.hook

        def exec_module(module: Any) -> None:
            run(module)
            hook()

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def after_import(name: str, hook: Callable[[], None]) -> None:
    """Call ``hook`` when the module ``name`` is imported, or now where it already is.
    `hydra_ensembles` registers its pipeline tasks this way when ``transformers.pipelines`` loads
    (``from transformers import pipeline`` loads it), without importing it itself."""
    if name in sys.modules:
        hook()
    else:
        sys.meta_path.insert(0, _AfterImport(name, hook))


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]], submodules: tuple[str, ...] = ()):
    """A package's ``__getattr__``, ``__dir__`` and ``__all__`` that import each public name's
    module on its first use (PEP 562): ``exports`` maps a relative module (``".fusion"``) to the
    names it gives; ``submodules`` are the public submodules (every submodule is an attribute, as
    after its import). A package that re-exports this way costs nothing to import until a name is
    used, so importing one light module under it (an error class, a file helper) imports no torch."""
    module_of = {name: module for module, names in exports.items() for name in names}
    public = sorted([*module_of, *submodules])
    shadowed = {name for name in module_of if importlib.util.find_spec(f"{package}.{name}") is not None}
    if shadowed:  # a submodule named as an exported name (evaluation.predict, the function)
        sys.modules[package].__class__ = _keeping_exports(shadowed)

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
                return importlib.import_module(f".{name}", package)  # any submodule, as if imported
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_of[name], package), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(public))

    return __getattr__, __dir__, public


def _keeping_exports(names: set[str]) -> type:
    """A module class whose attributes ``names`` keep meaning the exported names: importing a
    submodule of the same name sets it as the package's attribute, which would replace the name
    the package exports (an eager ``from .predict import predict`` rebinds it; a lazy one does not)."""

    class Exports(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if name in names and getattr(value, "__name__", "") == f"{self.__name__}.{name}":
                return  # the submodule stays reachable as sys.modules[...] and by its full name
            super().__setattr__(name, value)

    return Exports


_FIRST_USE: dict[str, list[Callable[[], None]]] = {}


def on_first_use(cls: str, hook: Callable[[], None]) -> None:
    """Call ``hook`` once, when the first instance of the class ``cls`` (its dotted path, so that
    waiting imports nothing) is made; the class calls `first_use`.
    `hydra_ensembles` registers the serving classes and pipeline tasks this way on the first
    `configuration.HydraConfig`: ``AutoModel...from_pretrained(folder)`` and ``pipeline(task,
    model=folder)`` read the folder's config before they look a class or task up, so importing
    transformers' modelling and pipeline code waits until a saved model is used."""
    _FIRST_USE.setdefault(cls, []).append(hook)


def first_use(cls: type) -> None:
    """Run (once) the hooks waiting for the first instance of the class ``cls``."""
    hooks = _FIRST_USE.get(f"{cls.__module__}.{cls.__qualname__}", [])
    while hooks:
        hooks.pop(0)()
