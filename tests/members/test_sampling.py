import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.members import least_useful_first
from hydra_ensembles.scoring import CircuitOrder


def _order():
    removed = [(1, 3), (0, 2), (1, 0), (0, 0), (1, 1), (0, 3)]
    return CircuitOrder("avg", [4, 4], 0.9, removed, [0.9] * len(removed))


def test_per_layer_budget_and_pool():
    members = he.sample_members(_order(), num_members=5, heads_per_layer=2, seed=0)
    for hs in members:
        kept = hs.resolve([4, 4])
        assert [len(k) for k in kept] == [2, 2]
    # pool = the 4 least useful heads of each layer here (2 pruned per layer, pool 2 x 2): any pair
    assert len({hs for hs in members}) > 1


def test_pool_equal_to_pruned_gives_identical_deterministic_members_and_says_so():
    with pytest.warns(UserWarning, match="one model, not an ensemble"):
        members = he.sample_members(_order(), num_members=3, heads_per_layer=3, pool_size=1)
    assert members[0] == members[1] == members[2] == he.HeadSet({0: [0, 1, 3], 1: [0, 1, 2]})


def test_seeds_reproduce_and_differ():
    a = he.sample_members(_order(), 3, num_pruned=3, pool_size=6, seed=1)
    assert a == he.sample_members(_order(), 3, num_pruned=3, pool_size=6, seed=1)
    assert a != he.sample_members(_order(), 3, num_pruned=3, pool_size=6, seed=2)
    for hs in a:
        assert hs.num_kept([4, 4]) == 5
        gone = {(lay, h) for lay in range(2) for h in range(4)} - {
            (lay, h) for lay, ks in enumerate(hs.resolve([4, 4])) for h in ks
        }
        assert gone <= set(_order().removed)


def test_taylor_scores_rank_lowest_first():
    scores = torch.tensor([[0.5, 0.1, 0.9], [0.2, 0.8, float("nan")]])
    order, heads = least_useful_first(scores)
    assert heads == [3, 2] and order[:2] == [(0, 1), (1, 0)]
    (member,) = he.sample_members(scores, 1, num_pruned=2, pool_size=2)
    assert member == he.HeadSet({0: [0, 2], 1: [1]})


def test_overlap_matrix():
    members = [he.HeadSet({0: [0, 1]}), he.HeadSet({0: [1, 2]})]
    overlap = he.member_overlap(members, [3])
    assert np.allclose(overlap, [[1, 1 / 3], [1 / 3, 1]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        he.sample_members(_order(), 2)
    with pytest.raises(ValueError, match="num_members"):
        he.sample_members(_order(), 0, heads_per_layer=2)
    with pytest.raises(he.HeadSetError, match="pool_size"):
        he.sample_members(_order(), 2, heads_per_layer=2, pool_size=1)
    with pytest.raises(he.HeadSetError, match="heads_per_layer"):
        he.sample_members(_order(), 2, heads_per_layer=5)


def test_duplicate_members_among_distinct_ones_are_warned():
    """Six members drawn from a pool that allows fewer distinct head sets: the copies are said."""
    scores = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    with pytest.warns(UserWarning, match=r"only \d of the 6 members keep distinct heads"):
        members = he.sample_members(scores, 6, num_pruned=1, pool_size=2, seed=0)
    assert len(set(members)) < 6
