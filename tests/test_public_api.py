"""The public names: every name in ``__all__`` exists, and the names removed from the package
are gone (the package has no released users that would need them)."""

import importlib

import pytest

import hydra_ensembles as he


def test_every_public_name_exists():
    assert all(hasattr(he, name) for name in he.__all__)
    assert "HydraOutput" not in he.__all__ and "EnsembleOutput" in he.__all__


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("hydra_ensembles", "HydraOutput"),
        ("hydra_ensembles.fusion", "HydraOutput"),
        ("hydra_ensembles.members", "fine_tune"),
        ("hydra_ensembles.members", "batch_ensemble"),
        ("hydra_ensembles.saving", "load_any"),
        ("hydra_ensembles.data", "load_bbc_news"),
    ],
)
def test_removed_names_are_gone(module, name):
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), name)


@pytest.mark.parametrize(
    "module", ["io", "serialization", "zeroshot", "saving.loading", "evaluation.bootstrap", "_moved"]
)
def test_removed_modules_are_gone(module):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"hydra_ensembles.{module}")
