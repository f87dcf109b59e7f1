"""Zero-shot dual encoders, tested against explicit computation on tiny random CLIPs and BERTs."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import hydra_ensembles as he
from hydra_ensembles.evaluation import predict
from hydra_ensembles.outputs import ensemble_nll
from hydra_ensembles.scoring.circuit import extract_circuit
from hydra_ensembles.zero_shot import (
    DualEncoderConfig,
    ZeroShotHydra,
    ZeroShotLoadError,
    fuse_dual_encoder,
    split_head_set,
)
from tests.factories import (
    image_inputs,
    labelled,
    patch_inputs,
    text_inputs,
    tiny_clip_model,
    tiny_clip_zero_shot,
    tiny_sentence_zero_shot,
    tiny_siglip_model,
    tiny_siglip_zero_shot,
)

FAMILIES = {
    "clip": (tiny_clip_zero_shot, image_inputs),
    "siglip": (tiny_siglip_zero_shot, image_inputs),
    "siglip2": (functools.partial(tiny_siglip_zero_shot, version=2), patch_inputs),
    "sentence": (tiny_sentence_zero_shot, text_inputs),
    "mpnet-sentence": (functools.partial(tiny_sentence_zero_shot, encoder="mpnet"), text_inputs),
}


def _explicit_logits(model, inputs):
    """Zero-shot logits written out: normalised embeddings, templates averaged, scale x cosine."""
    x = F.normalize(model.input_tower(**inputs), dim=-1)
    prompts = F.normalize(model.label_tower(**model.prompt_inputs), dim=-1)
    classes = F.normalize(
        prompts.view(model.config.num_labels, len(model.config.templates), -1).mean(1), dim=-1
    )
    return model.config.logit_scale * x @ classes.T + model.config.logit_bias


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_scaled_cosines_with_templates_averaged(family):
    make, inputs = FAMILIES[family]
    model = make(classes=4, templates=3)
    batch = inputs(5)
    torch.testing.assert_close(model(**batch).logits, _explicit_logits(model, batch))
    if family == "clip":  # CLIP's own learned scale
        assert model.config.logit_scale == pytest.approx(float(tiny_clip_model().logit_scale.detach().exp()))


def test_clip_zero_shot_matches_clipmodel_logits_per_image():
    clip = tiny_clip_model()
    model = tiny_clip_zero_shot(templates=1)
    batch = image_inputs(4)
    reference = clip(pixel_values=batch["pixel_values"], **model.prompt_inputs).logits_per_image
    torch.testing.assert_close(model(**batch).logits, reference)


@pytest.mark.parametrize("version", [1, 2], ids=["siglip", "siglip2"])
def test_siglip_zero_shot_gives_siglipmodels_sigmoid_logits_and_softmax_probabilities(version, tmp_path):
    """SigLIP's (and SigLIP 2's) logits are exp(t) x cosine + b, its own ``logits_per_image``; the
    ensemble's probabilities are their softmax over the classes, where the bias cancels."""
    from hydra_ensembles.zero_shot import ZeroShotHydra, from_siglip

    siglip = tiny_siglip_model(version=version)
    ids = torch.randint(3, 40, (3, 8), generator=torch.Generator().manual_seed(1))
    model = from_siglip(siglip, ["a", "b", "c"], ["{}"], prompt_inputs={"input_ids": ids})
    assert model.config.logit_bias == pytest.approx(-4.0) and model.config.logit_scale == pytest.approx(
        math.exp(2.3)
    )
    pixels = image_inputs(4) if version == 1 else patch_inputs(4)
    with torch.no_grad():
        expected = siglip(input_ids=ids, **pixels).logits_per_image
        out = model(**pixels)
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-5)
    unbiased = (out.logits - model.config.logit_bias).softmax(-1)
    torch.testing.assert_close(out.logits.softmax(-1), unbiased)
    hydra = fuse_dual_encoder(model, [he.HeadSet.full(he.get_adapter(model).original_heads_per_layer(model))])
    hydra.save_pretrained(tmp_path / "zs")
    loaded = ZeroShotHydra.from_pretrained(tmp_path / "zs")
    assert loaded.config.logit_bias == model.config.logit_bias
    with torch.no_grad():
        torch.testing.assert_close(loaded(**pixels).member_logits[0], out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pool", ["both", "input"])
def test_pruning_equals_masking_in_both_towers(family, pool):
    make, inputs = FAMILIES[family]
    model = make(heads_pool=pool)
    batch = inputs(5)
    heads = he.get_adapter(model).original_heads_per_layer(model)
    assert len(heads) == (4 if pool == "both" else 2)
    head_sets = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({1: [1]}), he.HeadSet.full(heads)]
    if pool == "both":
        head_sets += [he.HeadSet({2: [], 3: [1]}), he.HeadSet({0: [3], 3: []})]
    for hs in head_sets:
        pruned = he.prune(model, hs)
        with he.ablate(model, hs):
            masked = model(**batch).logits
        torch.testing.assert_close(pruned(**batch).logits, masked, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            pruned(**batch).logits, _explicit_logits(pruned, batch), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pool", ["both", "input"])
@pytest.mark.parametrize("shared_trunk", [True, False])
def test_fused_zero_shot_hydra_equals_members_run_one_by_one(family, pool, shared_trunk):
    make, inputs = FAMILIES[family]
    model = make(classes=3, templates=2, heads_pool=pool)
    if pool == "both":  # ragged members, 0-head layers in either tower, a shared first layer
        head_sets = [
            he.HeadSet({0: [0, 1], 1: [2], 2: [], 3: [0]}),
            he.HeadSet({0: [0, 1], 1: [], 3: [1]}),
            he.HeadSet({0: [0, 1], 1: [0, 1, 3], 2: [1]}),
        ]
    else:
        head_sets = [he.HeadSet({0: [0, 1], 1: [2]}), he.HeadSet({0: [0, 1], 1: []}), he.HeadSet({0: [0, 1]})]
    fused = fuse_dual_encoder(model, head_sets, shared_trunk=shared_trunk)
    assert fused.input_hydra.trunk_layers == (1 if shared_trunk else 0)
    batch = labelled(inputs(6, seed=3), labels=3)
    labels = batch.pop("labels")
    out = fused(**batch, labels=labels)
    explicit = torch.stack([he.prune(model, hs)(**batch).logits for hs in head_sets])
    torch.testing.assert_close(out.member_logits, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.probs, explicit.softmax(-1).mean(0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.loss, ensemble_nll(explicit, labels), atol=1e-5, rtol=1e-5)
    predictions = predict(fused, [batch], progress=False)
    assert predictions.member_logits.shape == (3, 6, 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_split_head_set_gives_each_tower_its_heads(family):
    model = FAMILIES[family][0]()
    input_heads, label_heads = split_head_set(model, he.HeadSet({0: [1], 3: []}))
    assert input_heads.layers[0] == (1,) and input_heads.layers[1] == (0, 1, 2, 3)
    assert label_heads.layers[1] == () and len(label_heads.layers[0]) > 0
    only_input = FAMILIES[family][0](heads_pool="input")
    assert split_head_set(only_input, he.HeadSet({0: [1]}))[1] is None


# Every pair of the three settings, not their 30 combinations (a covering array): each family in
# both pools and under every objective, each objective in both pools. The objective enters only
# through the members' logits (`circuit.objectives`), the same code for every family.
PAIRWISE = [
    (family, ("both", "input")[(i + j) % 2], objective)
    for i, family in enumerate(FAMILIES)
    for j, objective in enumerate(("acc", "ood", "avg"))
]


@pytest.mark.parametrize(("family", "pool", "objective"), PAIRWISE)
def test_circuit_fast_equals_reference_over_both_towers(family, pool, objective, monkeypatch):
    """Fast extraction removes the reference's heads with its scores; over both towers, once a head
    of one tower is removed, the candidates of the other are scored without running it."""
    from hydra_ensembles.scoring.circuit import candidates as circuit_candidates
    from hydra_ensembles.scoring.circuit import extract as circuit_extract

    skipped = []

    class Spy(circuit_candidates.SuffixCache):
        def removed(self, head):
            super().removed(head)
            skipped.append(len(self.complete))  # the next step scores these without running them

    monkeypatch.setattr(circuit_extract, "SuffixCache", Spy)
    make, inputs = FAMILIES[family]
    model = make(heads_pool=pool, seed=1)
    id_val = [labelled(inputs(6, seed=s), labels=3, seed=s) for s in (1, 2)]
    ood_val = [inputs(5, seed=9)]
    budget = 7 if pool == "both" else 5
    orders = {
        method: extract_circuit(
            model, id_val, ood_val, objective=objective, budget=budget, method=method, progress=False
        )
        for method in ("reference", "fast")
    }
    assert orders["fast"].removed == orders["reference"].removed
    assert orders["fast"].scores == pytest.approx(orders["reference"].scores, abs=1e-12)
    layers = {layer for layer, _ in orders["fast"].removed}
    assert layers <= set(range(4 if pool == "both" else 2))
    if pool == "both":
        assert max(skipped) > 0


def test_taylor_scores_cover_both_towers():
    model = tiny_sentence_zero_shot()
    calib = [labelled(text_inputs(6, seed=s), labels=3, seed=s) for s in (1, 2)]
    scores = he.taylor_scores(model, calib)
    assert scores.shape == (4, 4) and torch.isfinite(scores).all() and (scores > 0).all()
    kept = he.taylor_head_set(model, calib, heads_per_layer=2, progress=False)
    assert kept.num_kept([4, 4, 4, 4]) == 8


def test_input_only_pool_caches_class_embeddings_until_the_label_tower_changes():
    model = tiny_sentence_zero_shot(heads_pool="input")
    first = model.class_embeddings()
    assert model.class_embeddings() is first  # cached
    with torch.no_grad():
        model.label_tower.model.encoder.layer[0].attention.self.query.weight.mul_(3.0)
    changed = model.class_embeddings()
    assert changed is not first and not torch.allclose(changed, first)


def test_save_and_load_reproduce_outputs_bitwise_and_refuse_tampering(tmp_path):
    model = tiny_clip_zero_shot()
    fused = fuse_dual_encoder(model, [he.HeadSet({0: [0, 1], 3: []}), he.HeadSet({1: [2], 2: [0]})])
    batch = image_inputs(4)
    fused.save_pretrained(tmp_path / "zs")
    loaded = ZeroShotHydra.from_pretrained(tmp_path / "zs")
    assert torch.equal(loaded(**batch).member_logits, fused(**batch).member_logits)
    assert loaded.config.classes == model.config.classes and loaded.config.templates == model.config.templates
    assert loaded.head_sets == fused.head_sets
    config_file = tmp_path / "zs" / "zero_shot_config.json"
    config = json.loads(config_file.read_text())
    config["dual_encoder"]["logit_scale"] = 1.0
    config_file.write_text(json.dumps(config))
    with pytest.raises(ZeroShotLoadError, match=r"checksum|digest|edited|tamper|SHA"):
        ZeroShotHydra.from_pretrained(tmp_path / "zs")


def test_bad_configurations_are_refused_with_clear_errors():
    with pytest.raises(ValueError, match="'\\{\\}'"):
        DualEncoderConfig(["a", "b"], ["no placeholder"])
    with pytest.raises(ValueError, match="distinct"):
        DualEncoderConfig(["a", "a"])
    with pytest.raises(ValueError, match="positive"):
        DualEncoderConfig(["a", "b"], logit_scale=0.0)
    with pytest.raises(ValueError, match="at least two class names"):
        DualEncoderConfig(["a"])
    with pytest.raises(ValueError, match="must not be empty"):
        DualEncoderConfig(["a", "b", ""])
    for template in ("{} and {}", "{topic}", "a {"):
        with pytest.raises(ValueError, match="template"):
            DualEncoderConfig(["a", "b"], [template])
    assert DualEncoderConfig(["a", "b"], ["{{literal}} {}"]).prompts() == ["{literal} a", "{literal} b"]
    model = tiny_sentence_zero_shot(classes=3, templates=2)
    with pytest.raises(ValueError, match="6 rows"):
        type(model)(model.input_tower, model.label_tower, text_inputs(5), model.config)
    with pytest.raises(ValueError, match="unpruned"):
        fuse_dual_encoder(he.prune(model, he.HeadSet({0: [0]})), [he.HeadSet({0: [0]})])
    with pytest.raises(TypeError, match="DualEncoderClassifier"):
        fuse_dual_encoder(model.input_tower.model, [he.HeadSet()])


def test_class_embeddings_are_computed_without_dropout_whatever_the_mode():
    model = tiny_sentence_zero_shot(dropout=0.5)
    head_sets = [he.HeadSet({2: [0, 1]}), he.HeadSet({3: [2]})]
    expected = fuse_dual_encoder(model, head_sets).class_embeddings
    model.train()  # e.g. left in training mode by a caller
    torch.manual_seed(1)
    assert torch.equal(fuse_dual_encoder(model, head_sets).class_embeddings, expected)
    assert model.training
