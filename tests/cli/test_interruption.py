"""Interruption: processes really killed with SIGKILL (circuit extraction, ``build --fine-tune``
mid-epoch, ``save_pretrained``) or interrupted with SIGINT, then resumed or reloaded: the final
results equal an uninterrupted run's, a half-written model never loads, and what the killed
process left behind is cleaned by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.loading import load_any
from hydra_ensembles.models import load_tokenizer

KILL = "os.kill(os.getpid(), signal.SIGKILL)"


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, num_labels=2
    )
    BertForSequenceClassification(config).save_pretrained(root / "model")
    load_tokenizer().save_pretrained(root / "model")
    rows = [f"goal match team score {i},sport" for i in range(16)]
    rows += [f"bank shares market profit {i},money" for i in range(16)]
    (root / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    return root


def child(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python process (after the imports every snippet needs)."""
    prelude = (
        "import os, signal, sys\nimport torch\nfrom hydra_cli import main\n"
        "from tests.precision_use import record_from_environment\nrecord_from_environment()\n"
        # the parent's threads: results compared with the parent's are reduced in the same order
        f"torch.set_num_threads({torch.get_num_threads()})\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the parent's precision (HYDRA_PRECISION) too
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def score_args(w: Path, out: str, checkpoint: str) -> list[str]:
    return [
        "score", str(w / "model"), "--data", str(w / "train.csv"), "--objective", "acc", "--budget", "5",
        "--batch-size", "8", "--max-length", "12", "--checkpoint", str(w / checkpoint), "--out", str(w / out),
    ]  # fmt: skip


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_circuit_extraction_killed_then_resumed_gives_the_same_order(w):
    assert main(score_args(w, "straight.json", "straight-ck.json")) == 0
    killed = child(
        f"""
        from hydra_ensembles.scoring.circuit import search as circuit
        original, calls = circuit.atomic_write_json, []
        def write_then_die(*args, **kwargs):
            original(*args, **kwargs)
            calls.append(1)
            if len(calls) == 2:  # two greedy steps saved: the process dies without any cleanup
                {KILL}
        circuit.atomic_write_json = write_then_die
        main({score_args(w, "resumed.json", "ck.json")!r})
        """
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (w / "ck.json").is_file() and not (w / "resumed.json").exists()
    resumed = child(f"sys.exit(main({score_args(w, 'resumed.json', 'ck.json')!r}))")
    assert resumed.returncode == 0, resumed.stderr
    assert (w / "resumed.json").read_text() == (w / "straight.json").read_text()
    assert not (w / "ck.json").exists()  # removed after success (--keep-checkpoint keeps it)


def build_args(w: Path, out: str) -> list[str]:
    return [
        "build", str(w / "model"), "--scores", str(w / "straight.json"), "--members", "2",
        "--num-pruned", "2", "--pool-size", "4", "--fine-tune", "--data", str(w / "train.csv"),
        "--epochs", "3", "--lr", "1e-3", "--batch-size", "4", "--max-length", "12", "--out", str(w / out),
    ]  # fmt: skip


def killed_at_step(step: int, argv: list[str]) -> subprocess.CompletedProcess:
    """``main(argv)`` in a new process that SIGKILLs itself, without any cleanup, as it is about to
    take optimizer step number ``step``."""
    return child(
        f"""
        steps = []
        original = torch.optim.AdamW.step
        def step_then_die(self, *args, **kwargs):
            steps.append(1)
            if len(steps) == {step}:
                {KILL}
            return original(self, *args, **kwargs)
        torch.optim.AdamW.step = step_then_die
        main({argv!r})
        """
    )


def _contents(folder: Path) -> dict[Path, bytes]:
    """Every file under ``folder``, by relative path, with its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow  # three builds, one killed (11 s): CI's slow run
@pytest.mark.same_in_every_precision  # resuming in each precision: test_training.py's resume test
def test_build_fine_tune_killed_mid_epoch_then_resumed_gives_the_same_model(w):
    if not (w / "straight.json").is_file():
        assert main(score_args(w, "straight.json", "straight-ck.json")) == 0
    assert main(build_args(w, "built-straight")) == 0
    assert not (w / "built-straight" / "checkpoints").exists()  # removed after success
    # member 0 done (3 epochs of 8 steps), member 1 in its second epoch
    killed = killed_at_step(3 * 8 + 8 + 3, build_args(w, "built"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (w / "built" / "members" / "member-0").is_dir() and not (w / "built" / "hydra").exists()
    resumed = child(f"sys.exit(main({build_args(w, 'built')!r}))")
    assert resumed.returncode == 0, resumed.stderr
    straight = load_file(w / "built-straight" / "hydra" / "model.safetensors")
    again = load_file(w / "built" / "hydra" / "model.safetensors")
    assert straight.keys() == again.keys()
    for name, tensor in straight.items():
        assert torch.allclose(tensor, again[name], atol=1e-6), name


@pytest.mark.same_in_every_precision  # files left whole or replaced whole
def test_build_overwrite_killed_keeps_the_old_result_whole_and_resumes(w, tmp_path, capsys):
    """build --overwrite of a finished output, killed mid-member: the output is still the old
    result (byte for byte) and never a mix; the rerun resumes beside it and replaces it whole.
    A finished output holding a file of the user's is not replaced."""
    if not (w / "straight.json").is_file():
        assert main(score_args(w, "straight.json", "straight-ck.json")) == 0
    old = tmp_path / "built"
    assert main(build_args(w, str(old))) == 0
    before = _contents(old)
    again = [*build_args(w, str(old)), "--overwrite", "--lr", "2e-3"]
    killed = killed_at_step(3 * 8 + 3, again)  # member 0 saved, member 1 in its first epoch
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _contents(old) == before
    assert (tmp_path / ".built.overwrite" / "members" / "member-0").is_dir()
    assert main(again) == 0
    assert not (tmp_path / ".built.overwrite").exists()
    weights = Path("hydra", "model.safetensors")  # the new result (another lr) replaced the old one
    assert _contents(old)[weights] != before[weights]
    (old / "notes.txt").write_text("mine")
    assert main(again) == 2
    assert "notes.txt" in capsys.readouterr().err and (old / "notes.txt").read_text() == "mine"


def test_save_pretrained_killed_midway_never_loads_and_is_cleaned_by_the_next_save(w):
    model = load_any(str(w / "model"))
    hydra = he.fuse(model, [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [1, 3]})])
    out = w / "saved"
    killed = child(
        f"""
        import hydra_ensembles as he
        from hydra_ensembles.saving import formats as serialization
        from hydra_ensembles.loading import load_any
        original = serialization.save_file
        def half_then_die(state, path, *args, **kwargs):
            original(state, path, *args, **kwargs)
            with open(path, "r+b") as handle:  # the process dies in the middle of writing
                handle.truncate(os.path.getsize(path) // 2)
            {KILL}
        serialization.save_file = half_then_die
        heads = [he.HeadSet({{0: [0, 1]}}), he.HeadSet({{1: [1, 3]}})]
        hydra = he.fuse(load_any({str(w / "model")!r}), heads)
        hydra.save_pretrained({str(out)!r})
        """
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftovers = [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the killed save left its temporary file"
    with pytest.raises(he.HydraLoadError):
        he.load_hydra(out)
    hydra.save_pretrained(out)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    loaded = he.load_hydra(out)
    ids = torch.randint(1000, 2000, (3, 7))
    with torch.no_grad():
        expected = hydra(input_ids=ids).member_logits
        assert torch.allclose(loaded(input_ids=ids).member_logits, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("sent", "code", "word"),
    [
        # Python's own KeyboardInterrupt, caught where the command's Terminated is: CI's slow run
        pytest.param(signal.SIGINT, 130, "interrupted", marks=pytest.mark.slow),
        (signal.SIGTERM, 143, "terminated"),  # the command line's handler turns it into Terminated
    ],
)
@pytest.mark.same_in_every_precision
def test_ctrl_c_or_sigterm_ends_with_one_line_saying_how_to_resume(w, sent, code, word):
    """Ctrl-C, and SIGTERM (what a scheduler or a container stop sends), end the same way."""
    ready = w / f"ready-{word}"
    exit_code = code
    code = f"""
        import time
        from pathlib import Path
        from hydra_ensembles.scoring.circuit import search as circuit
        original = circuit.atomic_write_json
        def write_then_wait(*args, **kwargs):
            original(*args, **kwargs)
            Path({str(ready)!r}).touch()
            time.sleep(60)
        circuit.atomic_write_json = write_then_wait
        sys.exit(main({score_args(w, f"{word}.json", f"{word}-ck.json")!r}))
        """
    prelude = (
        "import os, signal, sys\nimport torch\nfrom hydra_cli import main\n"
        "from tests.precision_use import record_from_environment\nrecord_from_environment()\n"
        # the parent's threads: results compared with the parent's are reduced in the same order
        f"torch.set_num_threads({torch.get_num_threads()})\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the parent's precision (HYDRA_PRECISION) too
    process = subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a child inherits an ignored SIGINT (e.g. from a parent run under nohup): undo that, as
        # a user's shell would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300  # generous: a loaded 2-core machine starts the child slowly
    while not ready.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    if not ready.exists():
        process.kill()
        _, err = process.communicate(timeout=60)
        pytest.fail(
            f"the child never reached its first checkpoint (exit {process.returncode}):\n{err[-2000:]}"
        )
    process.send_signal(sent)
    _, err = process.communicate(timeout=60)
    assert process.returncode == exit_code, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"hydra-ens: {word}; rerun the same command with the same --checkpoint to resume"
    )
    assert (w / f"{word}-ck.json").is_file() and not (w / f"{word}.json").exists()
