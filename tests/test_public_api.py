"""The public names: every name in ``__all__`` exists, and old names of renamed concepts still
work for one release, with a deprecation warning."""

import pytest

import hydra_ensembles as he
from hydra_ensembles import fusion


def test_every_public_name_exists():
    assert all(hasattr(he, name) for name in he.__all__)
    assert "HydraOutput" not in he.__all__ and "EnsembleOutput" in he.__all__


@pytest.mark.parametrize("module", [he, fusion])
def test_hydra_output_is_the_ensemble_output_under_its_deprecated_name(module):
    with pytest.warns(DeprecationWarning, match="EnsembleOutput"):
        assert module.HydraOutput is he.EnsembleOutput
    with pytest.raises(AttributeError):
        module.NoSuchName  # noqa: B018


@pytest.mark.parametrize(
    ("name", "home"),
    [("fine_tune", "training"), ("FineTuneConfig", "training"), ("batch_ensemble", "baselines")],
)
def test_names_moved_out_of_members_still_import_from_there_with_a_warning(name, home):
    import importlib

    from hydra_ensembles import members

    with pytest.warns(DeprecationWarning, match=f"hydra_ensembles.{home}"):
        assert getattr(members, name) is getattr(importlib.import_module(f"hydra_ensembles.{home}"), name)
    assert name not in members.__all__
    with pytest.raises(AttributeError):
        members.NoSuchName  # noqa: B018
