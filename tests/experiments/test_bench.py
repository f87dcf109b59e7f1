"""hydra-ens bench: structure of the results (no timing assertions), memory tracking, targets."""

import json

import pytest
import torch

import hydra_ensembles as he
import hydra_ensembles.cost
from hydra_cli import main
from hydra_ensembles import sample_members
from hydra_experiments.bench import bench_report, check_targets, peak_memory, run_bench
from tests.factories import VOCAB, tiny_bert


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

    results = run_bench(
        model,
        heads,
        make,
        batch_sizes=(1, 4),
        dtypes=("float32",),
        repeats=2,
        test_set=6,
        test_batch=4,
        progress=lambda _: None,
    )
    table = results["dtypes"]["float32"]
    assert set(table) == {"Single", "Deep Ensemble", "Members one by one", "Hydra (fused)", "BatchEnsemble"}
    assert table["BatchEnsemble"]["gmacs_per_input"] >= table["Deep Ensemble"]["gmacs_per_input"]
    assert table["Deep Ensemble"]["params"] == 3 * table["Single"]["params"]
    assert table["Hydra (fused)"]["params"] == he.cost.count_parameters(he.fuse(model, heads))
    assert table["Hydra (fused)"]["gmacs_per_input"] == table["Members one by one"]["gmacs_per_input"]
    for row in table.values():
        assert set(row["latency"]) == {"1", "4"} and row["peak_memory_mb"] > 0 and row["test_set_s"] > 0
    lines = check_targets(results)
    assert len(lines) == 2 and all(("met" in line) or ("MISSED" in line) for line in lines)
    assert "| Hydra (fused) |" in bench_report(results, "test machine", "tiny")


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_bench_on_cuda():
    model = tiny_bert(layers=2, heads=4, head_dim=4)

    def make(batch):
        ids = torch.randint(1, VOCAB, (batch, 8))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    heads = sample_members(torch.zeros(2, 4), 3, heads_per_layer=2, pool_size=4)
    results = run_bench(
        model, heads, make, (1, 2), ("float32", "bfloat16"), repeats=1, progress=print, device="cuda"
    )
    assert results["device"] == "cuda" and "hydra_bf16_vs_single_fp32" in results
