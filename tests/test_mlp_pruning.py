"""MLP pruning (`surgery.prune_mlp`), the build's second cost knob: a pruned model computes what
the original computes with the dropped neurons' activations zeroed (a hook on the original, in
every family whose MLP is linear layers into and out of the hidden width, gated ones included);
it keeps the most important neurons by the norm product; it saves, loads and fuses like any model;
and the build and the sweep take it as a setting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hydra_ensembles.adapters import get_adapter
from hydra_ensembles.build import BuildConfig, build_hydra
from hydra_ensembles.errors import InputError, UnsupportedModelError
from hydra_ensembles.loading import load_any
from hydra_ensembles.surgery import prune_mlp
from hydra_ensembles.sweep import SweepConfig
from hydra_ensembles.training import FineTuneConfig
from tests.factories import (
    decoder_inputs,
    image_inputs,
    labelled,
    text_inputs,
    tiny_bert,
    tiny_deberta,
    tiny_decoder,
    tiny_dinov2,
    tiny_distilbert,
    tiny_electra,
    tiny_modernbert,
    tiny_mpnet,
    tiny_roberta,
    tiny_vit,
)

FAMILIES = {
    "bert": (tiny_bert, text_inputs),
    "roberta": (tiny_roberta, text_inputs),
    "electra": (tiny_electra, text_inputs),
    "distilbert": (tiny_distilbert, text_inputs),
    "mpnet": (tiny_mpnet, text_inputs),
    "deberta": (tiny_deberta, text_inputs),
    "vit": (tiny_vit, image_inputs),
    "decoder": (tiny_decoder, decoder_inputs),  # a gated MLP: gate and up projections
}


def _masked(model: nn.Module, keep: int):
    """The original model with every neuron but the ``keep`` of largest norm product zeroed at
    the output projection's input (what the pruned model must compute), written out: per layer,
    the linear layers into the hidden width and the one out of it, found by their shapes."""
    width = get_adapter(model).mlp_width(model)
    handles = []
    for layer in get_adapter(model).layers(model):
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        ins = [m for m in linears if m.out_features == width and m.in_features != width]
        (out,) = [m for m in linears if m.in_features == width and m.out_features != width]
        score = out.weight.norm(dim=0)
        for m in ins:
            score = score * m.weight.norm(dim=1)
        mask = torch.zeros(width)
        mask[score.topk(keep).indices] = 1
        handles.append(out.register_forward_pre_hook(lambda _m, args, mask=mask: (args[0] * mask,)))
    return handles


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("share", [0.25, 0.5, 0.9])
def test_a_pruned_mlp_computes_the_original_with_the_dropped_neurons_zeroed(family, share):
    make, inputs_of = FAMILIES[family]
    torch.manual_seed(0)
    model = make().eval()
    width = get_adapter(model).mlp_width(model)
    keep = max(1, round(share * width))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = prune_mlp(model, keep)
    assert get_adapter(pruned).mlp_width(pruned) == keep
    x = inputs_of(batch=3)
    handles = _masked(model, keep)
    with torch.no_grad():
        expected, got = model(**x).logits, pruned(**x).logits
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the input untouched
    smaller = sum(p.numel() for p in pruned.parameters()) < sum(p.numel() for p in model.parameters())
    assert smaller


def test_dinov2_prunes_to_a_whole_multiple_of_its_hidden_size_and_saves_it(tmp_path):
    """DINOv2's width is hidden_size * mlp_ratio (an integer): half of 2 x 12 neurons is one
    multiple; the pruned model computes the original with the rest zeroed, and loads back."""
    torch.manual_seed(0)
    model = tiny_dinov2().eval()
    assert get_adapter(model).mlp_width(model) == 24
    pruned = prune_mlp(model, 12)
    assert pruned.config.mlp_ratio == 1 and get_adapter(pruned).mlp_width(pruned) == 12
    x = image_inputs(batch=3)
    handles = _masked(model, 12)
    with torch.no_grad():
        expected, got = model(**x).logits, pruned(**x).logits
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    pruned.save_pretrained(tmp_path)
    loaded = type(pruned).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(**x).logits, got)


def test_mlp_pruning_refuses_what_it_cannot_record_or_cut():
    with pytest.raises(UnsupportedModelError, match="not linear layers into and out of"):
        prune_mlp(tiny_modernbert(), 8)  # gate and up in one matrix
    # DINOv2 records its width as a whole multiple of the hidden size (12 here), a SwiGLU one not at all
    with pytest.raises(UnsupportedModelError, match="cannot record 8 neurons; keep a multiple of 12"):
        prune_mlp(tiny_dinov2(), 8)
    swiglu = tiny_dinov2()
    swiglu.config.use_swiglu_ffn = True
    with pytest.raises(UnsupportedModelError, match="SwiGLU"):
        prune_mlp(swiglu, 12)
    model = tiny_bert()
    for keep in (0, 26, 1.5, True):
        with pytest.raises(InputError, match="an MLP keeps between 1 and its 25 neurons"):
            prune_mlp(model, keep)


def test_a_build_with_a_narrower_mlp_fuses_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = tiny_bert().eval()
    batches = [
        labelled(text_inputs(batch=8, seed=s), labels=model.config.num_labels, seed=s) for s in range(3)
    ]
    config = BuildConfig(
        num_members=2, num_pruned=2, mlp_keep=0.5, mlp="exact", fine_tune=FineTuneConfig(epochs=1)
    )
    built = build_hydra(model, batches, batches, config=config, progress=False)
    assert [m.config.intermediate_size for m in built.members] == [12, 12]
    x = text_inputs(batch=4)
    with torch.no_grad():
        fused = built.hydra(**x).member_logits
        explicit = torch.stack([m(**x).logits for m in built.members])
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)
    built.hydra.save_pretrained(tmp_path / "hydra")
    loaded = load_any(str(tmp_path / "hydra"))
    with torch.no_grad():
        assert torch.equal(loaded(**x).member_logits, built.hydra(**x).member_logits)
    assert model.config.intermediate_size == 25  # the model given is left as it was


def test_the_build_and_the_sweep_take_the_share_as_a_setting():
    tuning = FineTuneConfig(epochs=1)
    with pytest.raises(InputError, match="needs fine_tune"):
        BuildConfig(num_members=2, num_pruned=2, mlp_keep=0.5)
    with pytest.raises(InputError, match="no keep_base"):
        BuildConfig(num_members=2, num_pruned=2, mlp_keep=0.5, keep_base=True, fine_tune=tuning)
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="share of MLP neurons"):
            BuildConfig(num_members=2, num_pruned=2, mlp_keep=bad, fine_tune=tuning)
    grid = SweepConfig(
        members=(2,), num_pruned=(4,), keep_base=(False, True), mlp_keep=(1.0, 0.5), fine_tune=tuning
    )
    names = [c.name for c in grid.candidates()]
    assert names == ["single", "hydra-m2-p4-t0", "hydra-m2-p4-t0-mlp50", "hydra-m2-p4-t0-base"]
    assert grid.candidates()[2].build.mlp_keep == 0.5
    with pytest.raises(InputError, match="mlp_keep must be distinct shares"):
        SweepConfig(members=(2,), num_pruned=(4,), mlp_keep=(0.5, 0.5))
