"""No import cycle in the package, imports inside functions included (benchmarks/import_graph.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "import_graph", Path(__file__).resolve().parents[1] / "benchmarks" / "import_graph.py"
)
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_the_package_has_no_import_cycle():
    graph = import_graph.import_graph()
    assert "hydra_ensembles.fusion.model" in graph and "hydra_ensembles.models" in graph
    assert "hydra_ensembles.serialization" in graph["hydra_ensembles.fusion.model"]
    assert import_graph.find_cycle(graph) is None


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    cycle = import_graph.find_cycle(graph)
    assert cycle is not None and set(cycle) == {"a", "b", "c"}


def test_the_library_does_not_import_the_application_layer():
    graph = import_graph.import_graph()
    roots = [
        f"hydra_ensembles.{m}" for m in ("cli", "experiment", "zero_shot_demo", "analyze", "tasks", "bench")
    ]
    app = {m for m in graph if any(m == r or m.startswith(r + ".") for r in roots)}
    assert "hydra_ensembles.experiment.stages" in app
    library = [m for m in graph if m not in app and m != "hydra_ensembles"]
    assert not {m: graph[m] & app for m in library if graph[m] & app}
