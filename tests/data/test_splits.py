import pytest

from hydra_ensembles.data import split_indices, split_of, stable_sample, stable_unit


def test_splits_are_deterministic_and_independent_of_order():
    keys = [f"doc-{i}" for i in range(500)]
    parts = split_indices(keys, {"train": 0.6, "val": 0.2, "test": 0.2}, salt="s")
    reversed_parts = split_indices(keys[::-1], {"train": 0.6, "val": 0.2, "test": 0.2}, salt="s")
    assert {keys[i] for i in parts["test"]} == {keys[::-1][i] for i in reversed_parts["test"]}
    assert sorted(i for p in parts.values() for i in p) == list(range(500))
    assert 0.5 < len(parts["train"]) / 500 < 0.7


def test_salt_changes_the_split_and_unit_is_in_range():
    assert split_of("a", {"x": 0.5, "y": 0.5}, salt="1") in {"x", "y"}
    assert 0 <= stable_unit("a") < 1
    assert stable_unit("a", "1") != stable_unit("a", "2")


def test_bad_fractions():
    with pytest.raises(ValueError, match="sum to 1"):
        split_of("a", {"x": 0.5, "y": 0.6})


def test_stable_sample_is_a_hash_ordered_prefix():
    keys = [f"k{i}" for i in range(100)]
    first = stable_sample(range(100), keys, 10)
    assert first == stable_sample(range(100), keys, 20)[:10]
    assert first != list(range(10))
