"""The text and zero-shot demos end to end on a tiny BERT (random weights, the MiniLM tokenizer),
with every opt-in row: the demos' code paths (training, caching, fusion, evaluation, the fp32
evaluation row of a reduced precision, reports, cost) in whatever precision the run computes in.
`scripts/test.sh` runs them again in bf16 and fp16, where the real-model demos would be too slow
on a CPU without native bf16. The numbers mean nothing (a random model); that everything runs,
and what each report holds, is checked."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from hydra_ensembles.models import SCRATCH_IMAGE_MODEL, SMALL_VITS, load_tokenizer
from hydra_ensembles.precision import resolve_precision
from hydra_experiments import Cache, DemoConfig, TrainingRecipe, run_demo
from hydra_experiments.zero_shot import run_zero_shot_demo

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
COMMON = {
    "shift_limit": 2,
    "members": 2,
    "pool_size": 6,
    "circuit_budget": 6,
    "circuit_id_items": 4,
    "circuit_ood_items": 4,
    "circuit_length": 12,
    "max_length": 16,
    "bench_repeats": 1,
    "bootstrap": 20,  # the intervals' code path; their width is not what these tests check
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**TINY, num_labels=4)).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return str(folder)


def _check_precision_rows(report: str, results: dict, fp32_row: bool) -> None:
    """The report names its precision; with ``fp32_row`` (the supervised demos), Hydra is also
    evaluated in fp32 exactly where the run computed in a reduced precision."""
    chosen = resolve_precision("auto")
    assert f"- **precision**: {chosen}\n" in report
    assert ("Hydra (Circ), fp32 evaluation" in results) == (fp32_row and chosen.reduced)
    for name, method in results.items():
        acc = method["classification"]["acc"]
        assert 0 <= acc <= 1 and method["classification"]["nll"] == method["classification"]["nll"], name


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_text_demo_on_a_tiny_model_with_every_opt_in_row(tmp_path, tiny):
    config = DemoConfig(
        model=tiny,
        train_limit=16,
        test_limit=16,
        ood_limit=8,
        num_pruned=3,
        heads_per_layer=2,  # Taylor's single pruned model: 2 of 4 heads per layer
        mc_samples=2,
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=8),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        trunk_study=True,
        batch_ensemble=True,
        wanda=True,
        oba=True,
        mlp_keep=0.5,
        **COMMON,
    )
    first = run_demo(config)
    report = (tmp_path / "report" / "report.md").read_text()
    results = json.loads((tmp_path / "report" / "results.json").read_text())["results"]
    assert set(results) == set(first["results"])
    unstructured = {"OBA (unstructured, single pruned)", "Wanda (unstructured, single pruned)"}
    assert {"Hydra (Circ)", "BatchEnsemble (M=2)"} | unstructured <= set(results)
    assert "unstructured pruning**: OBA, Wanda: " in report and "MLP weights zeroed" in report
    assert "- **Hydra members' MLP**: 0.5 of each layer's neurons" in report
    members = (tmp_path / "cache").glob("member-*/member_config.json")
    widths = [json.loads(c.read_text())["config"]["intermediate_size"] for c in members]
    # the Hydra members at half width; the single pruned models at full width
    assert TINY["intermediate_size"] // 2 in widths and TINY["intermediate_size"] in widths
    _check_precision_rows(report, results, fp32_row=True)
    # every layer's view is measured for each model that records its layers (and only those)
    for name in ("Single", "Deep Ensemble (M=2)", "Hydra (Circ)", "Taylor (single pruned)"):
        assert "mds_layers" in results[name]["ood_summary"], name
    assert "mds_layers" not in results["BatchEnsemble (M=2)"]["ood_summary"]
    cache = Cache(config.cache_dir, True)
    again = run_demo(config, cache)  # from the cache: nothing trained or extracted again, the same numbers
    assert cache.built == [] and again["results"] == first["results"]


def test_zero_shot_demo_on_a_tiny_encoder(tmp_path, tiny):
    config = DemoConfig.preset(
        "zero-shot",
        model=tiny,
        train_limit=8,
        val_limit=12,
        test_limit=12,
        ood_limit=8,
        num_pruned=3,
        curve_step=2,
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        **COMMON,
    )
    result = run_zero_shot_demo(config)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "zero-shot benchmark" in report and "## Cost" in report
    assert {"Single", "Hydra (Circ)", "Hydra (Circ, input tower)"} <= set(result["results"])
    _check_precision_rows(report, result["results"], fp32_row=False)


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_image_demo_on_a_tiny_vit_with_every_opt_in_row(tmp_path, monkeypatch, capsys):
    """The image demo's from-scratch path (the small-ViT model; Packed-Ensembles and MIMO from
    scratch, BatchEnsemble, Wanda; the shifted and OOD image sets) on a 2-layer ViT of 4 heads."""
    tiny = {**SMALL_VITS[SCRATCH_IMAGE_MODEL], "hidden_size": 16, "num_hidden_layers": 2}
    tiny |= {"num_attention_heads": 4, "intermediate_size": 32}
    monkeypatch.setitem(SMALL_VITS, "vit-tiny", tiny)
    config = DemoConfig.preset(
        "image",
        model="vit-tiny",
        train_limit=32,
        val_limit=16,
        test_limit=16,
        ood_limit=8,
        num_pruned=3,
        heads_per_layer=2,
        mc_samples=2,
        recipe=TrainingRecipe(epochs=1, member_epochs=1, batch_size=16, lr=1e-3),
        out_dir=tmp_path / "report",
        cache_dir=tmp_path / "cache",
        packed=True,
        mimo=True,
        batch_ensemble=True,
        wanda=True,
        oba=True,
        **{k: v for k, v in COMMON.items() if not k.endswith("length")},  # tokens: text only
    )
    result = run_demo(config)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "image benchmark" in report and "trained from scratch" in report and "ELPV" in report
    rows = {"Hydra (Circ)", "Packed-Ensembles (M=2, α=2, from scratch)", "MIMO (M=2, ρ=0.5, batch repeat 4)"}
    assert rows <= set(result["results"]) and rows - {"Hydra (Circ)"} <= set(result["cost"]["methods"])
    assert {"BatchEnsemble (M=2)", "Wanda (unstructured, single pruned)"} <= set(result["results"])
    assert "OBA (unstructured, single pruned)" in result["results"]
    assert not any("from pretrained" in name for name in result["results"])  # nothing pretrained
    assert "MC Dropout" in result["results"]  # the scratch ViT has dropout to sample
    for method in result["results"].values():
        assert set(method["ood"]) == {"fashion-held-out", "mnist", "textures"}  # ELPV: validation only
        assert len(method["shift"]) == 6 * 5 and "gaussian_noise@5" in method["shift"]
    assert "images of 1x28x28" in capsys.readouterr().out
    _check_precision_rows(report, result["results"], fp32_row=True)
