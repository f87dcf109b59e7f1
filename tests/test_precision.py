"""The precision decision: auto picks bf16 only where it is native (flags, else a cached probe); the
forcing variables let these tests check every branch on any CPU."""

import warnings

import pytest
import torch

import hydra_ensembles.precision as precision
import hydra_ensembles.runtime as runtime
from hydra_ensembles.precision import Precision, in_precision, resolve_precision
from hydra_ensembles.training import FineTuneConfig


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch):
    monkeypatch.delenv(precision.PRECISION_ENV, raising=False)
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)


def _cpu_flags(monkeypatch, flags):
    monkeypatch.setattr(precision, "cpu_info", lambda: ("test CPU", frozenset(flags)))


def test_forced_emulated_cpu_gets_fp32(monkeypatch):
    monkeypatch.setenv(precision.CPU_BF16_ENV, "emulated")
    chosen = resolve_precision("auto", "cpu")
    assert chosen.name == "fp32" and chosen.dtype == torch.float32
    assert "HYDRA_CPU_BF16" in chosen.reason and not chosen.reduced


def test_forced_native_cpu_gets_bf16_without_probing(monkeypatch):
    monkeypatch.setenv(precision.CPU_BF16_ENV, "native")
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("probe ran"))
    chosen = resolve_precision("auto", "cpu")
    assert chosen.name == "bf16" and chosen.dtype == torch.bfloat16 and chosen.reduced


def test_avx2_flags_skip_the_probe_and_say_why(monkeypatch):
    _cpu_flags(monkeypatch, {"avx", "avx2", "fma"})
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("probe ran"))
    chosen = resolve_precision("auto")
    assert str(chosen) == "fp32 (auto: this CPU has no native bf16 (no AVX-512 BF16 or AMX))"


@pytest.mark.parametrize(
    ("flags", "why"),
    [({"avx512_bf16"}, "AVX-512 BF16"), ({"amx_bf16", "avx512_bf16"}, "AMX"), ({"amx_bf16"}, "AMX")],
)
def test_native_flags_decide_without_a_probe(monkeypatch, flags, why):
    """Unambiguous flags decide alone: a busy machine's timings cannot flip the choice."""
    _cpu_flags(monkeypatch, flags)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("probe ran"))
    chosen = resolve_precision("auto")
    assert chosen.name == "bf16" and why in chosen.reason


@pytest.mark.parametrize(
    ("speedup", "expected"), [(0.02, "fp32"), (1.2, "fp32"), (1.3, "bf16"), (9.0, "bf16")]
)
def test_unknown_flags_leave_it_to_the_probe_with_a_margin(monkeypatch, speedup, expected):
    _cpu_flags(monkeypatch, set())
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: speedup)
    chosen = resolve_precision("auto")
    assert chosen.name == expected and "flags are unknown" in chosen.reason and "measured" in chosen.reason


def _fake_clock(monkeypatch, rounds, repeats):
    """perf_counter for `measure_bf16_speedup`: per round, fp32 then bf16 runs of the given times."""

    def ticks():
        for fp32, bf16 in rounds:
            for duration in [fp32] * repeats + [bf16] * repeats:
                yield 0.0
                yield duration

    clock = ticks()
    monkeypatch.setattr(precision.time, "perf_counter", lambda: next(clock))


def test_the_probe_is_a_median_of_interleaved_rounds(monkeypatch):
    """One slow round (a busy machine) does not decide: the median of the rounds' ratios does."""
    _fake_clock(monkeypatch, [(1.0, 0.25), (1.0, 100.0), (1.0, 0.25), (1.0, 0.25), (0.01, 1.0)], 3)
    assert precision.measure_bf16_speedup(size=8, rounds=5, repeats=3) == pytest.approx(4.0)


def test_the_probe_stops_early_where_bf16_is_emulated(monkeypatch):
    _fake_clock(monkeypatch, [(0.01, 0.5)] * 3, 2)  # a fourth round would exhaust the fake clock
    assert precision.measure_bf16_speedup(size=8, rounds=7, repeats=2) == pytest.approx(0.02)


def test_the_probe_runs_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv(runtime.MACHINE_CACHE_ENV, str(tmp_path))
    calls = []
    monkeypatch.setattr(precision, "measure_bf16_speedup", lambda: calls.append(1) or 2.5)
    precision.cpu_bf16_speedup.cache_clear()
    try:
        assert precision.cpu_bf16_speedup() == 2.5
        precision.cpu_bf16_speedup.cache_clear()  # a new process: reads the machine's cache file
        assert precision.cpu_bf16_speedup() == 2.5 and calls == [1]
        assert runtime.machine_cache_path().parent == tmp_path
        runtime.machine_cache_path().write_text("[damaged")  # unreadable: measured again, rewritten
        precision.cpu_bf16_speedup.cache_clear()
        assert precision.cpu_bf16_speedup() == 2.5 and calls == [1, 1]
    finally:
        precision.cpu_bf16_speedup.cache_clear()


def test_the_real_probe_measures_a_ratio():
    ratio = precision.measure_bf16_speedup(size=64, rounds=3, repeats=2)
    assert ratio > 0


def test_hydra_precision_replaces_auto_but_not_an_explicit_choice(monkeypatch):
    monkeypatch.setenv(precision.PRECISION_ENV, "bf16")
    assert resolve_precision("auto").name == "bf16"
    assert resolve_precision("fp32").name == "fp32"
    monkeypatch.setenv(precision.PRECISION_ENV, "fp8")
    with pytest.raises(ValueError, match="HYDRA_PRECISION"):
        resolve_precision("auto")


def test_explicit_emulated_bf16_warns_but_obeys(monkeypatch):
    monkeypatch.setenv(precision.CPU_BF16_ENV, "emulated")
    with pytest.warns(UserWarning, match="much slower than fp32"):
        chosen = resolve_precision("bf16", "cpu")
    assert chosen.name == "bf16" and chosen.reason.startswith("requested;")
    monkeypatch.setenv(precision.CPU_BF16_ENV, "native")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_precision("bf16", "cpu") == Precision("bf16", "requested")


def test_cuda_rules(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", "cuda").name == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    chosen = resolve_precision("auto", "cuda:0")
    assert chosen.name == "fp16" and "no bf16" in chosen.reason
    assert resolve_precision("auto", "meta").name == "fp32"


@pytest.mark.parametrize("bad", ["fp8", "float32", "", "BF16"])
def test_unknown_precisions_are_refused(bad):
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision(bad)
    with pytest.raises(ValueError, match="precision must be one of"):
        FineTuneConfig(precision=bad).validate()


def test_autocast_and_casting():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with Precision("fp32", "test").autocast("cpu"):
        assert (a @ b).dtype == torch.float32
    with Precision("bf16", "test").autocast("cpu"):
        assert (a @ b).dtype == torch.bfloat16
    model = torch.nn.Linear(4, 4)
    assert in_precision(model, Precision("fp32", "test")) is model
    cast = in_precision(model, Precision("bf16", "test"))
    assert cast is not model and cast.weight.dtype == torch.bfloat16 and model.weight.dtype == torch.float32
