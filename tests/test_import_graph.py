"""No import cycle among the packages, imports inside functions included (benchmarks/import_graph.py), and
the layers import only downwards."""

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
    assert "hydra_ensembles.saving.formats" in graph["hydra_ensembles.fusion.model"]
    assert import_graph.find_cycle(graph) is None


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    cycle = import_graph.find_cycle(graph)
    assert cycle is not None and set(cycle) == {"a", "b", "c"}


def _under(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def layer_violations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports against the layering library (hydra_ensembles) < applications (hydra_experiments:
    the demos, the analysis, the benchmark) < command line (hydra_cli, which runs both): one
    top-level package per layer."""
    cli = {m for m in graph if _under(m, "hydra_cli")}
    apps = {m for m in graph if _under(m, "hydra_experiments")}
    above = {m: apps | cli for m in graph if m not in apps | cli} | {m: cli for m in apps}
    return {m: graph[m] & higher for m, higher in above.items() if graph[m] & higher}


def test_the_layers_import_only_downwards():
    graph = import_graph.import_graph()
    assert {"hydra_experiments.stages", "hydra_experiments.zero_shot", "hydra_experiments.bench"} <= set(
        graph
    )
    assert {"hydra_ensembles.training", "hydra_ensembles.baselines", "hydra_cli.demo"} <= set(graph)
    assert layer_violations(graph) == {}
    assert {m.partition(".")[0] for m in graph} == {"hydra_ensembles", "hydra_experiments", "hydra_cli"}
    assert graph["hydra_cli.demo"] & {m for m in graph if _under(m, "hydra_experiments")}


def test_a_layer_violation_is_seen():
    graph = {
        "hydra_ensembles.heads": {"hydra_experiments.stages"},
        "hydra_experiments.stages": {"hydra_ensembles.heads", "hydra_cli.main"},
        "hydra_cli.main": {"hydra_experiments.stages", "hydra_ensembles.heads"},
    }
    assert layer_violations(graph) == {
        "hydra_ensembles.heads": {"hydra_experiments.stages"},
        "hydra_experiments.stages": {"hydra_cli.main"},
    }


def test_the_library_parts_form_layers():
    """Each sub-package and top-level module of the library imports only parts below it, imports
    inside functions included: saving (files, formats, metadata) is a floor no model package
    sits under, and loading, which must know every model kind, sits above them."""
    parts = import_graph.part_graph(import_graph.import_graph())
    assert {"hydra_ensembles.saving", "hydra_ensembles.fusion", "hydra_ensembles.loading"} <= set(parts)
    assert import_graph.find_cycle(parts) is None
    layers = import_graph.part_layers(parts)
    level = {part: i for i, names in enumerate(layers) for part in names}
    for model_package in ("fusion", "members", "zero_shot", "models", "configuration"):
        assert level["hydra_ensembles.saving"] < level[f"hydra_ensembles.{model_package}"]
        assert level[f"hydra_ensembles.{model_package}"] < level["hydra_ensembles.loading"]


def test_parts_importing_each_other_are_seen():
    graph = {
        "hydra_ensembles.saving.formats": {"hydra_ensembles.errors"},
        "hydra_ensembles.saving.loader": {"hydra_ensembles.fusion.model"},
        "hydra_ensembles.fusion.model": {"hydra_ensembles.saving.formats"},
        "hydra_ensembles.errors": set(),
        "hydra_ensembles": {"hydra_ensembles.fusion"},
    }
    parts = import_graph.part_graph(graph)
    assert parts == {
        "hydra_ensembles.saving": {"hydra_ensembles.errors", "hydra_ensembles.fusion"},
        "hydra_ensembles.fusion": {"hydra_ensembles.saving"},
        "hydra_ensembles.errors": set(),
    }
    assert set(import_graph.find_cycle(parts)) == {"hydra_ensembles.saving", "hydra_ensembles.fusion"}
    del graph["hydra_ensembles.saving.loader"]
    assert import_graph.part_layers(import_graph.part_graph(graph)) == [
        ["hydra_ensembles.errors"],
        ["hydra_ensembles.saving"],
        ["hydra_ensembles.fusion"],
    ]
