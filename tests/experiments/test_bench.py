"""hydra-ens bench: structure of the results (no timing assertions), memory tracking, targets."""

import json

import pytest
import torch

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles import sample_members
from hydra_ensembles.baselines.lora import lora_parts
from hydra_ensembles.baselines.packed import PACKED_KEY
from hydra_ensembles.cost import count_parameters, peak_memory
from hydra_experiments.bench import BenchConfig, bench_report, check_targets, run_bench
from hydra_experiments.bench_methods import distinct_members, packed_model
from tests.factories import VOCAB, tiny_bert


def _make(batch):
    ids = torch.randint(1, VOCAB, (batch, 8))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_peak_memory_counts_new_tensors_and_frees():
    def run():
        a = torch.ones(1024, 256)  # 1 MiB
        b = a * 2  # another MiB while a is alive
        del a
        return b.sum()

    assert 2 * 2**20 <= peak_memory(run) < 3 * 2**20


def test_run_bench_reports_every_method(tmp_path):
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    heads = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4)
    assert len(set(heads)) == 3

    def make(batch):
        ids = torch.randint(1, VOCAB, (batch, 8))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    setting = BenchConfig(batch_sizes=(1, 4), dtypes=("float32",), repeats=2, test_set=6, test_batch=4)
    results = run_bench(model, heads, make, setting, progress=lambda _: None)
    table = results["dtypes"]["float32"]
    assert set(table) == {
        "Single",
        "Deep Ensemble",
        "Deep Ensemble (fused)",
        "LoRA-Ensemble (fused)",
        "Members one by one",
        "Hydra (fused)",
        "BatchEnsemble",
        "Packed-Ensembles",
    }
    assert table["BatchEnsemble"]["gmacs_per_input"] >= table["Deep Ensemble"]["gmacs_per_input"]
    packed = packed_model(model, 3)  # 4 heads x alpha 2 do not split into 3 members: alpha 3
    assert getattr(packed.config, PACKED_KEY)["alpha"] == 3
    assert table["Packed-Ensembles"]["params"] == count_parameters(packed)
    assert table["Deep Ensemble"]["params"] == 3 * table["Single"]["params"]
    assert table["Hydra (fused)"]["params"] == count_parameters(he.fuse(model, heads))
    assert table["Hydra (fused)"]["gmacs_per_input"] == table["Members one by one"]["gmacs_per_input"]
    # the fused deep ensemble holds every member's weights; the fused LoRA-Ensemble the base's
    # MLPs, embeddings and norms once, and per member its attention (grouped per member) and task head
    assert table["Deep Ensemble (fused)"]["params"] == table["Deep Ensemble"]["params"]
    adapter = he.adapters.get_adapter(model)
    apart = [f"{path}." for path in adapter.projection_paths] + [
        f"{h}." for h in adapter.task_head_modules(model)
    ]
    own = sum(p.numel() for name, p in model.named_parameters() if any(a in name for a in apart))
    assert 0 < own < table["Single"]["params"] / 2
    assert table["LoRA-Ensemble (fused)"]["params"] == table["Single"]["params"] + 2 * own
    for fused in ("Deep Ensemble (fused)", "LoRA-Ensemble (fused)"):
        assert table[fused]["gmacs_per_input"] == pytest.approx(
            table["Deep Ensemble"]["gmacs_per_input"], rel=0.05
        )
    for row in table.values():
        assert set(row["latency"]) == {"1", "4"} and row["peak_memory_mb"] > 0 and row["test_set_s"] > 0
    lines = check_targets(results)
    assert len(lines) == 2 and all(("met" in line) or ("MISSED" in line) for line in lines)
    assert "| Hydra (fused) |" in bench_report(results, "test machine", "tiny")


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_bench_command(tmp_path, capsys):
    path = tmp_path / "model"
    tiny_bert(layers=2, heads=4).save_pretrained(path)
    assert (
        main(
            [
                "bench",
                str(path),
                "--heads-per-layer",
                "2",
                "--tokens",
                "8",
                "--batch-sizes",
                "1,2",
                "--precision",
                "fp32,bf16,fp16",
                "--repeats",
                "1",
                "--test-set",
                "0",
                "--out",
                str(tmp_path / "b"),
                "--onnx",
                "--shared-layers",
                "1",
            ]
        )
        == 0
    )
    assert (
        "Hydra bf16 vs Single fp32 at batch 2 (interleaved side by side)"
        in (tmp_path / "b" / "bench.md").read_text()
    )
    cross = json.loads((tmp_path / "b" / "bench.json").read_text())["hydra_bf16_vs_single_fp32"]
    assert cross["batch"] == 2 and cross["Single float32 median_ms"] > 0
    assert cross["Hydra (fused) bfloat16 median_ms"] > 0
    timed = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert set(timed["dtypes"]) == {"bfloat16", "float16", "float32"}
    assert "fp16 (requested" in timed["precision"]
    # onnxruntime's latency beside PyTorch's, float32 only; the fused model's multiply-adds
    onnx = timed["dtypes"]["float32"]["Hydra (fused) onnxruntime"]
    fused = timed["dtypes"]["float32"]["Hydra (fused)"]
    assert onnx["latency"]["2"]["median_ms"] > 0 and onnx["gmacs_per_input"] == fused["gmacs_per_input"]
    assert onnx["peak_memory_mb"] >= 0  # the resident memory a fresh session gains over one run
    assert "Hydra (fused) onnxruntime" not in timed["dtypes"]["bfloat16"]
    assert "| Hydra (fused) onnxruntime |" in (tmp_path / "b" / "bench.md").read_text()
    assert "| Hydra (shared trunk) |" in (tmp_path / "b" / "bench.md").read_text()
    assert "**Packed-Ensembles**: alpha 3, gamma 1" in (tmp_path / "b" / "bench.md").read_text()
    for name in ("Single onnxruntime", "Single onnxruntime int8", "Hydra (fused) onnxruntime int8"):
        row, source = timed["dtypes"]["float32"][name], timed["dtypes"]["float32"][name.split(" onnx")[0]]
        assert row["latency"]["2"]["median_ms"] > 0 and row["gmacs_per_input"] == source["gmacs_per_input"]
    capsys.readouterr()


def test_bad_bench_requests_are_clear_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tiny_bert(layers=1, heads=2).save_pretrained(tmp_path / "model")
    model = str(tmp_path / "model")
    out = ["--out", str(tmp_path / "b")]
    assert main(["bench", model, "--heads-per-layer", "1", "--device", "cuda", *out]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["bench", model, "--heads-per-layer", "3", *out]) == 2
    assert "heads_per_layer must be in [1, 2]" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_shared_trunk_row_and_a_chosen_subset_of_methods():
    """The shared-trunk members are timed as one more fused model, with fewer multiply-adds than
    full Hydra (the trunk runs once); ``methods`` times only what it names, and Single."""
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    heads = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4)
    trunk = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4, shared_layers=1)

    def quiet(methods):
        return BenchConfig(batch_sizes=(2,), dtypes=("float32",), repeats=1, methods=methods)

    results = run_bench(model, heads, _make, quiet(("hydra", "trunk")), trunk, progress=lambda _: None)
    table = results["dtypes"]["float32"]
    assert list(table) == ["Single", "Hydra (fused)", "Hydra (shared trunk)"]
    assert table["Hydra (shared trunk)"]["gmacs_per_input"] < table["Hydra (fused)"]["gmacs_per_input"]
    assert check_targets(results) == []  # no deep ensemble to compare with, not a GPU
    with pytest.raises(he.InputError, match="unknown bench method"):
        run_bench(model, heads, _make, quiet(("hydra", "lora")))
    with pytest.raises(he.InputError, match="--shared-layers"):
        run_bench(model, heads, _make, quiet(("trunk",)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_bench_on_cuda():
    model = tiny_bert(layers=2, heads=4, head_dim=4)
    heads = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4)
    setting = BenchConfig(batch_sizes=(1, 2), dtypes=("float32", "bfloat16"), repeats=1, device="cuda")
    results = run_bench(model, heads, _make, setting)
    assert results["device"] == "cuda" and "hydra_bf16_vs_single_fp32" in results
    for row in results["dtypes"]["float32"].values():  # the CUDA allocator's peak over the weights
        assert row["peak_memory_mb"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_bench_compiled_with_cuda_graphs():
    model = tiny_bert(layers=2, heads=4, head_dim=8)
    heads = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4)
    setting = BenchConfig(
        batch_sizes=(2,),
        dtypes=("bfloat16",),
        repeats=2,
        device="cuda",
        methods=("hydra",),
        compile_mode="reduce-overhead",
    )
    results = run_bench(model, heads, _make, setting)
    table = results["dtypes"]["bfloat16"]
    assert results["compile"] == "reduce-overhead" and list(table) == ["Single", "Hydra (fused)"]
    assert table["Hydra (fused)"]["latency"]["2"]["median_ms"] > 0


def test_distinct_members_differ_where_they_trained_and_fuse_equal_to_their_ensemble():
    """The benchmark's members: copies apart in every weight (deep) or in LoRA's parts only, and
    their fusion is their explicit ensemble (the library's exactness, on these members too)."""
    model = tiny_bert(layers=2, heads=4, head_dim=4).eval()
    x = _make(3)
    for parts in (None, lora_parts(model)):
        members = distinct_members(model, 3, parts)
        for name, weight in members[2].named_parameters():
            moved = not torch.equal(weight, dict(model.named_parameters())[name])
            assert moved == (parts is None or parts(name)), name
        fused = he.fuse(members, mlp="exact").eval()
        with torch.no_grad():
            got = fused(**x).member_logits
            want = torch.stack([m(**x).logits for m in members])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
