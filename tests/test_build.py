"""build_hydra: the method in one call equals its steps done by hand, ranks heads the documented
way, calibrates on ID validation only, and saves what pipelines and predict load."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForSequenceClassification

import hydra_ensembles as he
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.loading import load_any
from hydra_ensembles.members import DeepEnsemble
from hydra_ensembles.scoring import CircuitConfig, CircuitOrder
from hydra_ensembles.training import FineTuneConfig, fine_tune

from .factories import labelled, text_inputs, tiny_bert

pytestmark = pytest.mark.filterwarnings("ignore:temperature fit on only")  # tiny validation sets


def _batches(n: int, seed: int, labels: bool = True) -> list[dict[str, torch.Tensor]]:
    batches = [text_inputs(batch=6, tokens=7, seed=seed + i) for i in range(n)]
    return [labelled(b, seed=seed + i) for i, b in enumerate(batches)] if labels else batches


def test_without_training_it_equals_taylor_ranking_sampling_and_fusion_by_hand():
    model, val = tiny_bert(), _batches(2, seed=10)
    config = he.BuildConfig(num_members=3, num_pruned=2, pool_size=4, seed=3, precision="fp32")
    built = he.build_hydra(model, validation=val, config=config, progress=False)
    scores = he.taylor_scores(model, val, precision="fp32")
    assert torch.equal(built.ranking, scores)  # no OOD data: Taylor on the ID validation data
    heads = he.sample_members(scores, 3, num_pruned=2, pool_size=4, seed=3)
    assert built.head_sets == heads and built.histories == []
    by_hand = he.fuse([he.prune(model, hs) for hs in heads])
    x = text_inputs(batch=5, seed=99)
    with torch.no_grad():
        assert torch.equal(built.hydra(**x).member_logits, by_hand(**x).member_logits)
    assert saved_calibration(built.hydra) == built.calibration and built.members_calibration is None


def test_with_ood_validation_heads_are_ranked_by_a_circuit():
    model, val, ood = tiny_bert(), _batches(1, seed=20), _batches(1, seed=30, labels=False)
    config = he.BuildConfig(num_members=2, num_pruned=2, budget=3, precision="fp32")
    built = he.build_hydra(model, validation=val, ood_validation=ood, config=config, progress=False)
    assert isinstance(built.ranking, CircuitOrder) and len(built.ranking.removed) == 3
    # every extraction setting passes through whole (the budget and the precision are the build's)
    settings = CircuitConfig(objective="acc", method="reference", budget=99)
    config = dataclasses.replace(config, circuit=settings)
    built = he.build_hydra(model, validation=val, ood_validation=ood, config=config, progress=False)
    expected = he.extract_circuit(model, val, ood, settings, budget=3, precision="fp32", progress=False)
    assert built.ranking == expected and built.ranking.objective == "acc"


def test_fine_tuned_members_equal_fine_tuning_by_hand_and_save_for_serving(tmp_path):
    model, train, val = tiny_bert(), _batches(2, seed=40), _batches(1, seed=50)
    tuning = FineTuneConfig(epochs=1, lr=1e-3, seed=5)
    config = he.BuildConfig(num_members=2, num_pruned=2, pool_size=4, fine_tune=tuning, precision="fp32")
    ranking = he.taylor_scores(model, val, precision="fp32")
    seen = []
    built = he.build_hydra(
        model, train, val, config=config, ranking=ranking, classes=["a", "b", "c"],
        on_member=lambda m, member, result: seen.append(m), progress=False,
    )  # fmt: skip
    assert seen == [0, 1] and len(built.histories) == 2
    x = text_inputs(batch=4, seed=7)
    for m, (member, hs) in enumerate(zip(built.members, built.head_sets, strict=True)):
        by_hand = he.prune(model, hs)
        fine_tune(
            by_hand, train, val, dataclasses.replace(tuning, seed=5 + m, precision="fp32"), progress=False
        )
        with torch.no_grad():
            assert torch.allclose(member(**x).logits, by_hand(**x).logits, atol=1e-6)
    assert built.members[0].config.id2label == {0: "a", 1: "b", 2: "c"}
    assert built.members_calibration is not None and built.calibration is not None
    built.save_pretrained(tmp_path / "built")
    assert saved_calibration(load_any(str(tmp_path / "built" / "hydra"))) == built.calibration
    assert saved_calibration(load_any(str(tmp_path / "built" / "members"))) == built.members_calibration
    served = AutoModelForSequenceClassification.from_pretrained(tmp_path / "built" / "hydra")
    assert served.config.id2label == {0: "a", 1: "b", 2: "c"}


def test_a_shared_trunk_is_a_build_setting_kept_shared_through_fine_tuning_and_saving(tmp_path):
    """``shared_layers=1``: every member keeps member 0's heads in layer 0 and fine-tunes only the
    later blocks, so the fused model runs layer 0 once, equals the members' explicit ensemble,
    and keeps its trunk when saved and loaded."""
    model, train, val = tiny_bert(), _batches(2, seed=60), _batches(1, seed=70)
    tuning = FineTuneConfig(epochs=1, lr=1e-3, seed=2)
    config = he.BuildConfig(
        num_members=2, num_pruned=2, pool_size=4, shared_layers=1, fine_tune=tuning, precision="fp32"
    )
    built = he.build_hydra(model, train, val, config=config, progress=False)
    assert built.hydra.trunk_layers == 1
    first = [dict(m.named_parameters()) for m in built.members]
    trunk = [name for name in first[0] if ".layer.0." in name or "embeddings" in name]
    assert trunk and all(torch.equal(first[0][n], first[1][n]) for n in trunk)  # not fine-tuned
    assert any(not torch.equal(first[0][n], first[1][n]) for n in first[0] if ".layer.1." in n)
    x = text_inputs(batch=4, seed=8)
    explicit = DeepEnsemble(built.members).eval()
    with torch.no_grad():
        torch.testing.assert_close(built.hydra.eval()(**x).probs, explicit(**x).probs, rtol=1e-5, atol=1e-6)
    built.save_pretrained(tmp_path / "trunk")
    loaded = he.load_hydra(tmp_path / "trunk" / "hydra")
    assert loaded.trunk_layers == 1
    with torch.no_grad():
        assert torch.equal(loaded(**x).member_logits, built.hydra(**x).member_logits)


def test_bootstrap_members_train_on_their_own_resamples_as_by_hand():
    """``bootstrap=True``: member m fine-tunes on the bootstrap resample of seed ``seed + m``
    (`bootstrap_batches`), as by hand; the resamples differ between members, hold as many
    examples, draw only training examples, and repeat some."""
    from hydra_ensembles.batching import bootstrap_batches

    model, train, val = tiny_bert(), _batches(3, seed=41), _batches(1, seed=51)
    tuning = FineTuneConfig(epochs=1, lr=1e-3, seed=3)
    config = he.BuildConfig(
        num_members=2, num_pruned=2, pool_size=4, fine_tune=tuning, bootstrap=True, precision="fp32"
    )
    built = he.build_hydra(model, train, val, config=config, progress=False)
    rows = {tuple(r.tolist()) for b in train for r in b["input_ids"]}
    resamples = [bootstrap_batches(train, 3 + m) for m in range(2)]
    drawn = [[tuple(r.tolist()) for b in res for r in b["input_ids"]] for res in resamples]
    for res in resamples:
        assert [b["labels"].shape[0] for b in res] == [b["labels"].shape[0] for b in train]
    assert drawn[0] != drawn[1] and all(len(set(d)) < len(d) for d in drawn)
    assert all(r in rows for d in drawn for r in d)
    x = text_inputs(batch=4, seed=9)
    for m, (member, hs) in enumerate(zip(built.members, built.head_sets, strict=True)):
        by_hand = he.prune(model, hs)
        settings = dataclasses.replace(tuning, seed=3 + m, precision="fp32")
        fine_tune(by_hand, resamples[m], val, settings, progress=False)
        with torch.no_grad():
            assert torch.allclose(member(**x).logits, by_hand(**x).logits, atol=1e-6)
    with pytest.raises(ValueError, match="needs fine_tune"):
        he.BuildConfig(num_pruned=2, bootstrap=True)


def test_keep_base_makes_the_model_itself_member_0_and_trains_the_others_as_by_hand():
    """``keep_base=True``: member 0 is the model, every head kept and not trained again; the other
    members are sampled (M - 1 of them) and trained with seeds ``seed + m`` as always; the fused
    model equals the members' explicit ensemble."""
    model, train, val = tiny_bert(), _batches(2, seed=42), _batches(1, seed=51)  # 3 classes in both halves
    tuning = FineTuneConfig(epochs=1, lr=1e-3, seed=6)
    config = he.BuildConfig(
        num_members=3, num_pruned=2, pool_size=4, fine_tune=tuning, keep_base=True, precision="fp32"
    )
    ranking = he.taylor_scores(model, val, precision="fp32")
    built = he.build_hydra(model, train, val, config=config, ranking=ranking, progress=False)
    sampled = he.sample_members(ranking, 2, num_pruned=2, pool_size=4, seed=0)
    assert built.head_sets[1:] == sampled and len(built.members) == 3
    every_head = he.HeadSet({layer: [0, 1, 2, 3] for layer in range(2)})  # tiny_bert: 2 layers of 4
    assert built.head_sets[0] == every_head and built.histories[0].optimizer_steps == 0
    x = text_inputs(batch=4, seed=10)
    with torch.no_grad():
        assert torch.equal(built.members[0](**x).logits, model(**x).logits)
    for m in (1, 2):
        by_hand = he.prune(model, built.head_sets[m])
        fine_tune(
            by_hand, train, val, dataclasses.replace(tuning, seed=6 + m, precision="fp32"), progress=False
        )
        with torch.no_grad():
            assert torch.allclose(built.members[m](**x).logits, by_hand(**x).logits, atol=1e-6)
    explicit = DeepEnsemble(built.members).eval()
    with torch.no_grad():
        torch.testing.assert_close(built.hydra.eval()(**x).probs, explicit(**x).probs, rtol=1e-5, atol=1e-6)
    for bad in ({"num_members": 1}, {"shared_layers": 1}):
        with pytest.raises(ValueError, match="keep_base"):
            he.BuildConfig(num_pruned=2, keep_base=True, **bad)


def test_bad_requests_are_refused_before_any_work():
    model = tiny_bert()
    with pytest.raises(ValueError, match="training batches"):
        he.build_hydra(
            model, validation=_batches(1, 1), config=he.BuildConfig(num_pruned=2, fine_tune=FineTuneConfig())
        )
    with pytest.raises(ValueError, match="ID validation"):
        he.build_hydra(model, config=he.BuildConfig(num_pruned=2))


def test_the_build_has_one_precision_and_a_nested_other_one_is_refused():
    """A fine-tuning or circuit setting naming another precision than the build's is refused, not
    silently replaced; ``auto`` (their default) and the build's own are accepted."""
    for nested in (
        {"fine_tune": FineTuneConfig(precision="fp16")},
        {"circuit": he.CircuitConfig(precision="bf16")},
    ):
        with pytest.raises(he.InputError, match=r"precision=.* differs from the build's precision='fp32'"):
            he.BuildConfig(num_pruned=2, precision="fp32", **nested)
    he.BuildConfig(num_pruned=2, precision="fp16", fine_tune=FineTuneConfig(precision="fp16"))
    he.BuildConfig(num_pruned=2, precision="fp32", fine_tune=FineTuneConfig(), circuit=he.CircuitConfig())


def test_every_step_is_said_as_it_starts():
    """build_hydra's log: ranking, sampling, each member's fine-tuning (with what is left after
    the first) and each of its epochs, fusion, calibration; nothing runs silently."""
    model, val, train = tiny_bert(), _batches(2, seed=40), _batches(2, seed=50)
    lines: list[str] = []
    config = he.BuildConfig(num_members=2, num_pruned=2, fine_tune=FineTuneConfig(epochs=2), precision="fp32")
    he.build_hydra(model, train, val, config=config, log=lines.append, progress=False)
    expected = [
        "ranking heads by Taylor importance",
        "sampling 2 members' head sets",
        "fine-tuning member 1 of 2",
        "member 1: epoch 1: train loss",
        "member 1: epoch 2: train loss",
        "fine-tuning member 2 of 2 (about",
        "member 2: epoch 2: train loss",
        "fusing 2 members into one model",
        "calibrating the members' ensemble",
        "calibrating the fused model (feature statistics on the training data)",
    ]
    found = iter(lines)  # in this order
    assert all(any(line.startswith(e) for line in found) for e in expected), lines
