"""Check the package's import graph for cycles, imports inside functions included.

A module-level cycle breaks an import outright; a cycle hidden in function-level imports couples
modules that should not know each other (e.g. a loader and what it loads). Prints the cycles
found (exit 1) or "no import cycle" (exit 0). ``python benchmarks/import_graph.py [--top-level]``

Inside the library the same holds one level up: its parts (each sub-package, each top-level
module) form layers, so no part imports one that imports it back, however indirectly (a loader
that must know every model kind sits above them; the files and formats they save with sit
below). ``--parts`` prints those layers, lowest first.
"""

from __future__ import annotations

import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# the library, and the applications built on it (the demos, the analysis, the benchmark)
PACKAGES = ("hydra_ensembles", "hydra_experiments", "hydra_cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> modules of both packages it imports (at module level, or anywhere)."""
    modules = {module_name(p): p for package in PACKAGES for p in (SRC / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = name.split(".") if is_package else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith(PACKAGES):
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    graph[name].add(full if full in modules else target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name.startswith(PACKAGES))
    return graph


def part_of(module: str, package: str = "hydra_ensembles") -> str | None:
    """The part of ``package`` a module belongs to: its sub-package or top-level module (None
    outside the package, and for the package's own ``__init__``, which re-exports its parts)."""
    names = module.split(".")
    if names[0] != package or len(names) == 1:
        return None
    return ".".join(names[:2])


def part_graph(graph: dict[str, set[str]], package: str = "hydra_ensembles") -> dict[str, set[str]]:
    """part -> the other parts of ``package`` its modules import (anywhere in them)."""
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        part = part_of(module, package)
        if part is None:
            continue
        found = {part_of(t, package) for t in targets}
        parts.setdefault(part, set()).update(found - {None, part})
    return parts


def part_layers(parts: dict[str, set[str]]) -> list[list[str]]:
    """The parts in layers, lowest first: each part imports only parts of lower layers (raises
    graphlib.CycleError where two parts import each other)."""
    sorter = TopologicalSorter(parts)
    sorter.prepare()
    layers = []
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        layers.append(ready)
        sorter.done(*ready)
    return layers


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return None


def main() -> int:
    graph = import_graph(top_level_only="--top-level" in sys.argv)
    if "--parts" in sys.argv:
        parts = part_graph(graph)
        cycle = find_cycle(parts)
        if cycle:
            print("parts importing each other: " + " -> ".join(cycle))
            return 1
        for level, names in enumerate(part_layers(parts)):
            print(f"{level:2d}  " + " ".join(n.removeprefix("hydra_ensembles.") for n in names))
        return 0
    cycle = find_cycle(graph)
    if cycle:
        print("import cycle: " + " -> ".join(cycle))
        return 1
    print(f"no import cycle among {len(graph)} modules (function-level imports included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
