import json

import pytest

from hydra_ensembles import HeadSet, HeadSetError


def test_layers_not_named_keep_all_heads():
    hs = HeadSet({0: [0, 2, 3], 1: [1], 2: []})
    assert hs.resolve([4, 4, 4, 4]) == ((0, 2, 3), (1,), (), (0, 1, 2, 3))
    assert hs.num_kept([4, 4, 4, 4]) == 8


def test_heads_are_sorted_and_values_compare_by_content():
    assert HeadSet({1: [3, 0]}) == HeadSet({"1": [0, 3]})
    assert hash(HeadSet({1: [3, 0]})) == hash(HeadSet({1: [0, 3]}))
    assert HeadSet({1: [0]}) != HeadSet({1: [1]})


def test_json_round_trip():
    hs = HeadSet({0: [0, 2, 3], 1: [1], 2: []})
    text = hs.to_json()
    assert json.loads(text) == {"0": [0, 2, 3], "1": [1], "2": []}
    assert HeadSet.from_json(text) == hs


def test_full_and_mask_agree():
    hs = HeadSet({0: [1], 1: []})
    assert hs.mask([3, 3]) == [[0, 1, 0], [0, 0, 0]]
    assert HeadSet.from_mask(hs.mask([3, 3])) == HeadSet({0: [1], 1: []})
    assert HeadSet.full([2, 2]).resolve([2, 2]) == ((0, 1), (0, 1))


def test_jaccard_and_subset():
    a, b = HeadSet({0: [0, 1], 1: [0]}), HeadSet({0: [1], 1: [0, 1]})
    assert a.jaccard(b, [2, 2]) == pytest.approx(2 / 4)
    assert HeadSet({0: [1], 1: [0]}).is_subset_of(a, [2, 2])
    assert not b.is_subset_of(a, [2, 2])


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ({0: [1, 1]}, "duplicate heads"),
        ({0: [-1]}, "non-negative"),
        ({-1: [0]}, "non-negative"),
        ({0: [1.5]}, "integer"),
        ({0: ["x"]}, "non-negative integer"),
        ({0: [True]}, "integer"),
    ],
)
def test_malformed_head_sets_are_refused(layers, message):
    with pytest.raises(HeadSetError, match=message):
        HeadSet(layers)


def test_validation_against_a_model_shape():
    with pytest.raises(HeadSetError, match="head index 4 out of range in layer 0"):
        HeadSet({0: [4]}).resolve([4, 4])
    with pytest.raises(HeadSetError, match="layer 2 out of range"):
        HeadSet({2: [0]}).resolve([4, 4])


def test_bad_json():
    with pytest.raises(HeadSetError, match="not valid JSON"):
        HeadSet.from_json("{")
    with pytest.raises(HeadSetError, match="object"):
        HeadSet.from_json("[1, 2]")


def test_read_head_sets_takes_one_head_set_or_a_list(tmp_path):
    from hydra_ensembles.saving.metadata import read_head_sets

    one, two = HeadSet({0: [0, 1], 1: [2]}), HeadSet({0: [3], 1: [0, 1]})
    (tmp_path / "one.json").write_text(json.dumps(one.to_dict()))
    (tmp_path / "two.json").write_text(json.dumps([one.to_dict(), two.to_dict()]))
    assert read_head_sets(tmp_path / "one.json") == [one]
    assert read_head_sets(tmp_path / "two.json") == [one, two]
    for bad in ("[]", "[1, 2]", '{"0": "x"}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(HeadSetError, match=r"bad\.json"):
            read_head_sets(tmp_path / "bad.json")
