"""Every supported family through the whole pipeline, against explicit computation, in float32:
adapter discovery, pruning == masking, untrained and fine-tuned fusion == the members run one by
one, shared trunk, save/load, circuit extraction fast == reference, Taylor scores, LoRA members."""

import pytest
import torch
from transformers import RobertaForTokenClassification

import hydra_ensembles as he
from hydra_ensembles.adapters.bert import FirstQueryAttention
from hydra_ensembles.baselines import lora_fine_tune
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.scoring import extract_circuit
from hydra_ensembles.training import FineTuneConfig
from tests.factories import DECODERS, FAMILIES, labelled

TOL = 1e-4
HEADS = [he.HeadSet({0: [0, 2], 1: []}), he.HeadSet({0: [1, 2, 3]}), he.HeadSet({1: [3], 2: [0, 1]})]


def _model(family: str, seed: int = 0) -> torch.nn.Module:
    factory, _ = FAMILIES[family]
    return factory(layers=3, heads=4, head_dim=3, init_range=0.3, seed=seed).eval()


def _inputs(family: str, batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    _, inputs = FAMILIES[family]
    return inputs(batch=batch, seed=seed)


def _logits(models, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([m.eval()(**inputs).logits for m in models])


def _perturbed(members):
    with torch.no_grad():
        for i, member in enumerate(members):
            g = torch.Generator().manual_seed(100 + i)
            for p in member.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return members


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_finds_every_layer_and_projection(family):
    model = _model(family)
    adapter = he.get_adapter(model)
    assert model.config.model_type in adapter.model_types
    assert adapter.num_layers(model) == 3 and adapter.original_heads_per_layer(model) == [4, 4, 4]
    block = adapter.attention_block(model, 1)
    head_dim = 4 if family in (*DECODERS, "modernbert") else 3  # rotary embeddings: an even size
    hidden = 16 if family == "modernbert" else 12  # ModernBERT's heads fill the hidden size
    assert (block.num_heads, block.head_dim, block.hidden_size) == (4, head_dim, hidden)
    assert block.query.out_features == 4 * head_dim
    assert adapter.task_head_modules(model)
    parts = {adapter.part_of(p, m) for p, m in model.named_modules() if list(m.parameters(recurse=False))}
    assert {"embeddings", "classifier", "norm", "mlp"} <= parts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pruning_equals_masking(family, seed):
    model = _model(family, seed)
    x = _inputs(family, batch=3, seed=seed)
    for heads in HEADS:
        pruned = he.prune(model, heads)
        with torch.no_grad(), he.ablate(model, heads):
            masked = model(**x).logits
        assert type(pruned) is type(model)
        assert (_logits([pruned], x)[0] - masked).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("batch", "seed"), [(1, 0), (3, 1), (5, 2)])
def test_untrained_fusion_equals_the_members(family, batch, seed):
    model = _model(family, seed)
    x = _inputs(family, batch=batch, seed=seed)
    with torch.no_grad():
        out = he.fuse(model, HEADS).eval()(**x)
    expected = _logits([he.prune(model, hs) for hs in HEADS], x)
    assert out.member_logits.shape == expected.shape
    assert (out.member_logits - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tuned_members_exact_and_merged_fusion(family, tmp_path):
    model = _model(family)
    members = _perturbed([he.prune(model, hs) for hs in HEADS])
    x = _inputs(family)
    exact = he.fuse(members, mlp="exact").eval()
    with torch.no_grad():
        out = exact(**x)
    assert (out.member_logits - _logits(members, x)).abs().max().item() <= TOL
    merged = he.fuse(members, mlp="merge").eval()
    save_member(members[2], tmp_path / "member")
    assert torch.equal(_logits([load_member(tmp_path / "member")], x), _logits(members[2:], x))
    for hydra in (exact, merged):
        folder = tmp_path / f"{family}-{hydra.policy.mlp}"
        hydra.save_pretrained(folder)
        with torch.no_grad():
            assert torch.equal(he.load_hydra(folder)(**x).member_logits, hydra(**x).member_logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_trunk_is_exact(family):
    model = _model(family)
    shared = {0: [0, 1, 3]}
    head_sets = [he.HeadSet({**shared, 1: [m], 2: [m, (m + 1) % 4]}) for m in range(3)]
    hydra = he.fuse(model, head_sets).eval()
    assert hydra.trunk_layers == 1
    x = _inputs(family, batch=3)
    with torch.no_grad():
        out = hydra(**x)
    assert (out.member_logits - _logits([he.prune(model, hs) for hs in head_sets], x)).abs().max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_circuit_fast_equals_reference_and_taylor_scores(family):
    model = _model(family)
    id_val = [labelled(_inputs(family, batch=6, seed=s), seed=s) for s in range(2)]
    ood_val = [_inputs(family, batch=5, seed=10)]
    # four steps reuse states across steps as any number does (deeper searches, every objective:
    # test_circuit.py's BERT tests); each family's part is its adapter's runtime shortcuts
    kwargs = {"objective": "avg", "budget": 4, "progress": False}
    ref = extract_circuit(model, id_val, ood_val, method="reference", **kwargs)
    fast = extract_circuit(model, id_val, ood_val, method="fast", **kwargs)
    assert fast.removed == ref.removed and fast.scores == pytest.approx(ref.scores)
    scores = he.taylor_scores(model, id_val)
    assert scores.shape == (3, 4) and torch.isfinite(torch.as_tensor(scores)).all()


@pytest.mark.parametrize("family", ["bert", "roberta", "electra"])
def test_first_token_only_for_sequence_classifiers(family):
    model = _model(family)
    adapter = he.get_adapter(model)
    x = _inputs(family, batch=5)
    with torch.no_grad():
        full = model(**x).logits
        with adapter.first_token_only(model):
            assert isinstance(adapter.layers(model)[-1].attention.self, FirstQueryAttention)
            short = model(**x).logits
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-6)
    token_classifier = RobertaForTokenClassification(model.config)  # reads every token
    assert adapter.first_token_only(token_classifier) is None


@pytest.mark.parametrize("family", ["distilbert", "deit"])
def test_first_token_only_declines_where_the_residual_is_inside_the_block(family):
    model = _model(family)
    assert he.get_adapter(model).first_token_only(model) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_members_train_the_task_head(family):
    model = _model(family)
    adapter = he.get_adapter(model)
    data = [labelled(_inputs(family, batch=4, seed=s), seed=s) for s in range(2)]
    config = FineTuneConfig(epochs=1, lr=1e-2, precision="fp32", warmup=0.0)
    merged, _ = lora_fine_tune(model, data, config=config, rank=2, alpha=4, progress=False)
    assert type(merged) is type(model)
    before, after = dict(model.named_parameters()), dict(merged.named_parameters())
    assert set(before) == set(after)
    for name in adapter.task_head_modules(model):
        changed = [n for n in before if n.startswith(name + ".") and not torch.equal(before[n], after[n])]
        assert changed, f"{family}: LoRA left the task head {name} untrained"
    q_name = adapter.projection_paths[0]
    assert any(q_name in n and not torch.equal(before[n], after[n]) for n in before)


def test_electra_projection_belongs_to_the_embeddings_and_blocks_the_trunk():
    model = _model("electra")
    adapter = he.get_adapter(model)
    path = "electra.embeddings_project"
    assert adapter.part_of(path, model.get_submodule(path)) == "embeddings"
    head_sets = [he.HeadSet({0: [0, 1], 1: [m], 2: [m]}) for m in range(3)]
    members = [he.prune(model, hs) for hs in head_sets]
    with torch.no_grad():  # members differ before the first layer only through the projection
        members[1].get_submodule(path).weight.add_(0.1)
    hydra = he.fuse(members, mlp="exact", embeddings="exact").eval()
    assert hydra.trunk_layers == 0  # a per-member projection needs M x B rows from the start
    x = _inputs("electra")
    with torch.no_grad():
        out = hydra(**x)
    assert (out.member_logits - _logits(members, x)).abs().max().item() <= TOL


def test_siglip_attention_pooling_head_is_task_head_and_never_pruned():
    """SigLIP's vision tower ends in an attention-pooling head (a ``nn.MultiheadAttention`` the
    classifier does not read): it is the task head's, not a layer's, so pruning and fusion leave
    it whole, and the classifier's mean over patches (no class token) is what members average."""
    model = _model("siglip")
    adapter = he.get_adapter(model)
    assert adapter.family == "SigLIP (vision)" and adapter.layers_path == "vision_model.encoder.layers"
    pooling = dict(model.vision_model.head.named_parameters())
    assert {adapter.part_of(f"vision_model.head.{n.rpartition('.')[0]}", None) for n in pooling} == {
        "classifier"
    }
    pruned = he.prune(model, HEADS[0])
    for name, param in pruned.vision_model.head.named_parameters():
        assert torch.equal(param, pooling[name])
    x = _inputs("siglip")
    hidden = pruned.vision_model(**x).last_hidden_state
    assert hidden.shape[1] == 4  # 2 x 2 patches, no class token
    expected = pruned.classifier(hidden.mean(dim=1))
    assert torch.allclose(pruned(**x).logits, expected, atol=1e-6)
    hydra = he.fuse(model, HEADS)
    assert torch.allclose(
        hydra(**x).member_logits, _logits([he.prune(model, hs) for hs in HEADS], x), atol=TOL
    )


def test_siglip2_padded_patches_change_nothing_in_pruned_and_fused_models():
    """SigLIP 2 takes images of several shapes as patches in fixed slots: the padded slots are
    masked in attention and in the mean pooling, so an image's logits are those of the same image
    without the padding, for a pruned member and for the fused model alike."""
    model = _model("siglip2")
    x = _inputs("siglip2", batch=3)
    assert x["pixel_attention_mask"].sum(1).tolist() == [4, 3, 2]
    members = [he.prune(model, hs) for hs in HEADS]
    hydra = he.fuse(model, HEADS).eval()
    with torch.no_grad():
        padded = hydra(**x).member_logits
        for row, patches in ((1, 3), (2, 2)):
            alone = {
                "pixel_values": x["pixel_values"][row : row + 1, :patches],
                "pixel_attention_mask": x["pixel_attention_mask"][row : row + 1, :patches],
                "spatial_shapes": x["spatial_shapes"][row : row + 1],
            }
            expected = _logits(members, alone)[:, 0]
            assert (hydra(**alone).member_logits[:, 0] - expected).abs().max().item() <= TOL
            assert (padded[:, row] - expected).abs().max().item() <= TOL
