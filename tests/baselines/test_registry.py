"""The baselines' registry: the library's transforms are registered, and the toy baseline of
docs/baselines.md (one module, one registration) saves, loads, runs as an ensemble and is described
like the built-in ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.baselines import registry
from hydra_ensembles.baselines.registry import MEMBER_TRANSFORMS, MemberTransform, register_member_transform
from hydra_ensembles.members import as_ensemble
from tests.factories import text_inputs, tiny_bert

PAGE = Path(__file__).resolve().parents[2] / "docs" / "baselines.md"


@pytest.fixture
def toy():
    """The page's module, executed; its registration is taken back afterwards."""
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    yield namespace
    MEMBER_TRANSFORMS.pop(namespace["MASKED_HEADS_KEY"], None)


def test_the_library_registers_its_transforms_in_rebuilding_order():
    names = [t.name for t in MEMBER_TRANSFORMS.values()]
    assert names[:4] == ["BatchEnsemble", "Deep Ensemble (D)", "MIMO", "Packed-Ensemble"]
    assert [t.name for t in MEMBER_TRANSFORMS.values() if t.before_pruning] == ["Packed-Ensemble"]


def test_a_toy_baseline_is_one_module_and_one_registration(toy, tmp_path, capsys):
    model = tiny_bert(layers=2, heads=4, head_dim=3, init_range=0.3).eval()
    head_set = he.HeadSet({0: [0, 2], 1: [1]})
    member = toy["masked_heads"](he.prune(model, head_set), 3).eval()
    x = text_inputs(batch=5, seed=3)
    assert registry.stacked_members(member) == 3
    he.save_member(member, tmp_path / "masked")
    loaded = he.load_member(tmp_path / "masked")
    with torch.no_grad():
        saved, again = member(**x).logits, loaded(**x).logits
        out = as_ensemble(loaded)(**x)
        heads, masks = loaded.classifier.heads, loaded.classifier.masks
        pooled = loaded.bert(**x).pooler_output
        by_hand = torch.stack([head(pooled * mask) for head, mask in zip(heads, masks, strict=True)])
    assert torch.equal(saved, again) and torch.equal(masks, member.classifier.masks)
    assert out.member_logits.shape == (3, 5, 3)
    assert (out.member_logits - by_hand).abs().max().item() <= 1e-6
    assert he.surgery.kept_heads(loaded) == head_set
    assert main(["info", str(tmp_path / "masked")]) == 0
    assert "Masked heads: 3 task heads, each on its own half of the features" in capsys.readouterr().out


def test_a_second_transform_claiming_a_taken_key_is_refused(toy):
    taken = MEMBER_TRANSFORMS[toy["MASKED_HEADS_KEY"]]
    other = MemberTransform("Another", taken.key, rebuild=lambda m, r: m, describe=str)
    with pytest.raises(ValueError, match=r"'masked_heads_members' is recorded by Masked heads already"):
        register_member_transform(other)
    assert MEMBER_TRANSFORMS[taken.key] is taken
