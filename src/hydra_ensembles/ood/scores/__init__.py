"""The built-in scores, one module each, registered in the order below (`ood.registry`): the
scores' order in every table and on the command line. The logit scores read the ensemble's
logits or probabilities; the feature scores read statistics of the members' features.

Scores of installed packages follow: each entry point of the group ``hydra_ensembles.scores``
names a module that registers one score or more, e.g. in the package's ``pyproject.toml``::

    [project.entry-points."hydra_ensembles.scores"]
    norm = "my_package.norm"

(docs/ood.md, "Adding a feature score"). A module that fails to import is skipped with a warning
naming it; a model that flags on its score then fails to load its calibration, saying so."""

import warnings
from importlib import import_module
from importlib.metadata import entry_points

GROUP = "hydra_ensembles.scores"
"""The entry-point group of installed packages' scores."""

for _module in (
    "msp",
    "max_logit",
    "energy",
    "entropy",
    "mutual_information",
    "gen",
    "mds",
    "rmds",
    "mds_plus",
    "knn",
    "vim",
    "mds_layers",
    "mds_disagreement",
):
    import_module(f"{__name__}.{_module}")

for _point in sorted(entry_points(group=GROUP), key=lambda point: point.name):
    try:
        _point.load()
    except Exception as exc:  # a broken plugin must not stop the library: say which, skip it
        warnings.warn(
            f"the OOD score entry point {_point.name!r} ({_point.value}) failed to load and is skipped: "
            f"{type(exc).__name__}: {exc}",
            stacklevel=2,
        )
