"""Fine-tuning members: trainable parts, learning, early stopping, resume, bad input."""

from pathlib import Path

import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.training import FineTuneConfig, fine_tune, trainable_parameters
from tests.factories import PRECISIONS, labelled, text_inputs, tiny_bert


def _data(n=4, seed=0):
    return [labelled(text_inputs(batch=8, tokens=6, seed=seed + s), seed=seed + s) for s in range(n)]


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_trainable_parts_select_parameters():
    model = tiny_bert(layers=3, heads=4)
    head_only = trainable_parameters(model, FineTuneConfig(trainable=("classifier",)))
    assert set(head_only) == {
        "bert.pooler.dense.weight",
        "bert.pooler.dense.bias",
        "classifier.weight",
        "classifier.bias",
    }
    attention = trainable_parameters(model, FineTuneConfig(trainable=("attention",)))
    assert all("attention.self" in n or "attention.output.dense" in n for n in attention)
    assert len(attention) == 3 * 8
    last = trainable_parameters(model, FineTuneConfig(trainable=("mlp", "norm"), last_k_blocks=1))
    assert last and all("layer.2." in n for n in last)


def test_fine_tuning_learns_and_trains_only_the_chosen_parts():
    model = he.prune(tiny_bert(layers=2, heads=4, init_range=0.1), he.HeadSet({0: [0, 1], 1: [3]}))
    train = _data()
    before = _snapshot(model)
    config = FineTuneConfig(epochs=8, lr=3e-3, trainable=("mlp", "classifier"), precision="fp32", warmup=0.0)
    result = fine_tune(model, train, val=train, config=config, progress=False)
    after = _snapshot(model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(trainable_parameters(model, config))
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.history[-1]["val_nll"] < result.history[0]["val_nll"]
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_fine_tuning_gives_the_callers_requires_grad_flags_back():
    model = he.prune(tiny_bert(layers=2, heads=4, init_range=0.1), he.HeadSet({0: [0, 1], 1: [3]}))
    frozen = {n for n, _ in model.named_parameters() if "embeddings" in n}
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    config = FineTuneConfig(epochs=1, lr=1e-3, trainable=("mlp",), precision="fp32")
    fine_tune(model, _data(), config=config, progress=False)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen


def test_sgd_label_smoothing_and_bf16_run():
    model = tiny_bert(layers=1, heads=2)
    config = FineTuneConfig(epochs=1, lr=1e-2, optimizer="sgd", label_smoothing=0.1, precision="bf16")
    result = fine_tune(model, _data(2), config=config, progress=False)
    assert len(result.history) == 1 and next(model.parameters()).dtype == torch.float32


def test_early_stopping_restores_the_best_epoch():
    model = tiny_bert(layers=1, heads=2, init_range=0.1)
    train, val = _data(3), _data(2, seed=50)  # random labels: validation NLL soon gets worse
    config = FineTuneConfig(epochs=30, lr=1e-2, patience=2, precision="fp32", warmup=0.0)
    result = fine_tune(model, train, val=val, config=config, progress=False)
    assert result.stopped_early and len(result.history) < 30
    best = min(r["val_nll"] for r in result.history)
    assert result.history[result.best_epoch]["val_nll"] == best
    from hydra_ensembles.training import evaluate_nll

    assert evaluate_nll(model, val)["nll"] == pytest.approx(best, rel=1e-5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resume_from_a_checkpoint_gives_the_same_weights(tmp_path, monkeypatch, precision):
    """In every precision (fp16: with its loss scale carried over)."""
    from hydra_ensembles import training as module

    train, val = _data(3), _data(1, seed=9)
    monkeypatch.setenv("HYDRA_PRECISION", precision)  # what `auto` resolves to on this "machine"
    config = FineTuneConfig(epochs=3, lr=1e-3, precision="auto")
    straight = tiny_bert(layers=1, heads=2)
    fine_tune(straight, train, val, config, progress=False)

    saves = []
    original = module.checkpoint.CheckpointDir.save

    def interrupt_after_two(*args, **kwargs):
        original(*args, **kwargs)
        saves.append(1)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(module.checkpoint.CheckpointDir, "save", interrupt_after_two)
    with pytest.raises(KeyboardInterrupt):
        fine_tune(tiny_bert(layers=1, heads=2), train, val, config, tmp_path, progress=False)
    monkeypatch.setattr(module.checkpoint.CheckpointDir, "save", original)
    assert (tmp_path / "manifest.json").is_file() and (tmp_path / "optimizer.2.safetensors").is_file()
    fresh = tiny_bert(layers=1, heads=2)  # a new process would start from the base weights again
    result = fine_tune(fresh, train, val, config, tmp_path, progress=False)
    assert len(result.history) == 3
    for (name, a), b in zip(straight.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
    # the same command where `auto` resolves otherwise (another machine) does not mix precisions
    monkeypatch.setenv("HYDRA_PRECISION", "fp32" if precision != "fp32" else "bf16")
    with pytest.raises(module.CheckpointError, match=f"trained in {precision}"):
        fine_tune(tiny_bert(layers=1, heads=2), train, val, config, tmp_path, progress=False)


class _Killed(BaseException):
    """A kill -9 at a file boundary: raised after a file operation, caught by nothing."""


def _writes(tmp_path, monkeypatch, train, val, config):
    """Every file operation of a checkpointed run (renames into place and removals), counted."""
    import os

    from hydra_ensembles.saving import files as io

    events = []
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        events.append(("replace", Path(dst).name))
        if len(events) == kill_at[0]:
            raise _Killed

    def unlink(self, *a, **k):
        real_unlink(self, *a, **k)
        events.append(("unlink", self.name))
        if len(events) == kill_at[0]:
            raise _Killed

    kill_at = [0]
    monkeypatch.setattr(io.os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    return events, kill_at


def test_a_kill_at_every_file_boundary_of_a_checkpoint_resumes_identically(tmp_path, monkeypatch):
    """The checkpoint is one set: killed after any of its files (or removals) lands, the rerun
    resumes from a consistent epoch and ends bit-identical to a run never interrupted."""
    train, val = _data(2), _data(1, seed=9)
    config = FineTuneConfig(epochs=3, lr=1e-3, precision="fp32", patience=5)
    straight = tiny_bert(layers=1, heads=2)
    fine_tune(straight, train, val, config, tmp_path / "straight", progress=False)
    events, kill_at = _writes(tmp_path, monkeypatch, train, val, config)
    fine_tune(tiny_bert(layers=1, heads=2), train, val, config, tmp_path / "count", progress=False)
    boundaries = len(events)
    assert boundaries >= 3 * 4  # per epoch: three files and the manifest land (then removals)
    for k in range(1, boundaries + 1):
        folder = tmp_path / f"killed-{k}"
        events.clear()
        kill_at[0] = k
        with pytest.raises(_Killed):
            fine_tune(tiny_bert(layers=1, heads=2), train, val, config, folder, progress=False)
        kill_at[0] = 0
        resumed = tiny_bert(layers=1, heads=2)
        result = fine_tune(resumed, train, val, config, folder, progress=False)
        assert [r["epoch"] for r in result.history] == [0, 1, 2], k
        for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
            assert torch.equal(a, b), (k, events[k - 1], name)
        generations = sorted(p.name for p in folder.iterdir())
        assert generations == ["best.3.safetensors", "manifest.json", "model.3.safetensors",
                               "optimizer.3.safetensors"], k  # fmt: skip


def test_a_damaged_checkpoint_file_is_refused_not_resumed(tmp_path):
    from hydra_ensembles.training import CheckpointError

    train = _data(2)
    config = FineTuneConfig(epochs=1, lr=1e-3, precision="fp32")
    fine_tune(tiny_bert(layers=1, heads=2), train, None, config, tmp_path, progress=False)
    weights = tmp_path / "model.1.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="differs from what was saved"):
        fine_tune(tiny_bert(layers=1, heads=2), train, None, config, tmp_path, progress=False)


def test_a_checkpoint_of_another_number_of_epochs_is_not_resumed(tmp_path):
    """A longer run's checkpoint would hand its longer-trained model to a shorter run."""
    from hydra_ensembles.training import CheckpointError

    train = _data(2)
    fine_tune(tiny_bert(layers=1, heads=2), train, None, FineTuneConfig(epochs=3, precision="fp32"),
              tmp_path, progress=False)  # fmt: skip
    with pytest.raises(CheckpointError, match="another configuration"):
        fine_tune(tiny_bert(layers=1, heads=2), train, None, FineTuneConfig(epochs=2, precision="fp32"),
                  tmp_path, progress=False)  # fmt: skip


def test_fp16_training_takes_overflowed_steps_again_and_says_so(monkeypatch):
    """A loss scale that overflows makes a step be taken again at half the scale (none lost); the
    history records the retries and the scale; a run that starts at a sane scale retries nothing."""
    from hydra_ensembles import training as module

    config = FineTuneConfig(epochs=2, lr=1e-3, precision="fp16", warmup=0.0)
    result = fine_tune(tiny_bert(layers=1, heads=2), _data(3), config=config, progress=False)
    assert all("fp16_overflow_retries" not in r and "skipped_steps" not in r for r in result.history)
    assert result.history[-1]["loss_scale"] == module.FP16_INITIAL_SCALE
    monkeypatch.setattr(module.loss_scale, "FP16_INITIAL_SCALE", 2.0**20)  # overflows: fp16 tops out at 65504
    model = tiny_bert(layers=1, heads=2)
    before = _snapshot(model)
    result = fine_tune(model, _data(3), config=config, progress=False)
    first = result.history[0]
    assert first["fp16_overflow_retries"] >= 1 and "skipped_steps" not in first
    assert first["loss_scale"] < 2.0**20
    assert all(not torch.equal(before[k], v) for k, v in _snapshot(model).items() if "embeddings" not in k)
    monkeypatch.setattr(module.loop, "FP16_RETRIES", 0)  # no retries left: the step is skipped and counted
    monkeypatch.setattr(module.loss_scale, "FP16_INITIAL_SCALE", 2.0**30)
    result = fine_tune(tiny_bert(layers=1, heads=2), _data(3), config=config, progress=False)
    assert result.history[0]["skipped_steps"] >= 1


def test_fp16_weights_are_refused_with_the_way_out():
    model = tiny_bert(layers=1, heads=2).half()
    with pytest.raises(ValueError, match=r"needs float32 weights.*precision='fp16'"):
        fine_tune(model, _data(2), config=FineTuneConfig(epochs=1, precision="fp16"), progress=False)


def test_member_save_load_round_trip(tmp_path):
    member = he.prune(tiny_bert(layers=2, heads=4), he.HeadSet({0: [1, 2], 1: []}))
    save_member(member, tmp_path)
    loaded = load_member(tmp_path)
    x = text_inputs()
    with torch.no_grad():
        assert torch.equal(member(**x).logits, loaded(**x).logits)
    assert he.kept_heads(loaded) == he.kept_heads(member)
    assert he.fuse([member, loaded]).num_members == 2  # same base fingerprint


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train": []}, "train is empty"),
        ({"train": [text_inputs()]}, "needs 'labels'"),
        ({"train": [{**text_inputs(), "labels": torch.tensor([0, 1, 2, 5])}]}, "labels out of range"),
        ({"config": FineTuneConfig(trainable=("everything",))}, "unknown trainable parts"),
        ({"config": FineTuneConfig(patience=1)}, "needs validation data"),
        ({"config": FineTuneConfig(optimizer="lion")}, "optimizer must be"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"train": _data(1), **kwargs}
    with pytest.raises(ValueError, match=message):
        fine_tune(tiny_bert(layers=1, heads=2), progress=False, **args)


DIST_WORKER = """
import os, sys, torch
sys.path.insert(0, {root!r})
from safetensors.torch import save_file
from tests.factories import tiny_bert, labelled, text_inputs
from hydra_ensembles.training import fine_tune, FineTuneConfig
torch.set_num_threads(1)
model = tiny_bert(layers=1, heads=2, dropout=0.0)
train = [labelled(text_inputs(batch=8, tokens=6, seed=s), seed=s) for s in range(5)]
config = FineTuneConfig(epochs=2, lr=1e-3, precision="fp32", batches_per_step=2)
fine_tune(model, train, config=config, progress=False)
if int(os.environ["RANK"]) == 0:
    save_file({{k: v.contiguous() for k, v in model.state_dict().items()}}, {out!r})
"""


@pytest.mark.slow  # two torch.distributed processes (8 s): CI's slow run
def test_two_processes_train_like_one(tmp_path):
    """Accelerate over 2 CPU processes (gloo) gives the weights of 1 process with the same
    batches per step (no dropout, so both draw the same randomness)."""
    import os
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "two.safetensors")
    script = tmp_path / "worker.py"
    script.write_text(DIST_WORKER.format(root=root, out=out))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]

    single = tiny_bert(layers=1, heads=2, dropout=0.0)
    train = [labelled(text_inputs(batch=8, tokens=6, seed=s), seed=s) for s in range(5)]
    config = FineTuneConfig(epochs=2, lr=1e-3, precision="fp32", batches_per_step=2)
    fine_tune(single, train, config=config, progress=False)
    two = load_file(out)
    for name, value in single.state_dict().items():
        assert torch.allclose(value, two[name], atol=1e-5), name
    assert not torch.allclose(single.classifier.weight, tiny_bert(layers=1, heads=2).classifier.weight)


def test_a_diverging_fine_tune_is_refused_not_saved(tmp_path):
    """A learning rate of 1e30 (or a NaN weight) gives NaN: refused with the way out, and no
    checkpoint of the broken weights is left to resume from."""
    from hydra_ensembles.training import TrainingDiverged

    config = FineTuneConfig(epochs=2, lr=1e30, precision="fp32", grad_clip=None, warmup=0.0)
    with pytest.raises(TrainingDiverged, match="lower the learning rate"):
        fine_tune(tiny_bert(layers=1, heads=2), _data(3), None, config, tmp_path, progress=False)
    assert not list(tmp_path.glob("model.*.safetensors"))
    model = tiny_bert(layers=1, heads=2)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"word_embeddings\.weight hold NaN or Inf"):
        fine_tune(model, _data(2), None, FineTuneConfig(epochs=1, precision="fp32"), progress=False)


def test_examples_are_dealt_into_new_batches_every_epoch():
    """A class-sorted file gives one-class batches; each epoch deals its examples anew (seeded),
    padding to the longest and trimming each new batch to its own longest mask."""
    from hydra_ensembles.batching import ExamplePool

    short = labelled(text_inputs(batch=4, tokens=5, seed=1, padded=False), labels=1)
    long = labelled(text_inputs(batch=3, tokens=9, seed=2), labels=1)
    long["labels"] = long["labels"] + 1
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    dealt = ExamplePool([short, long], pad_id=0).deal(order)
    assert [len(b["labels"]) for b in dealt] == [4, 3]
    rows = {}
    for batch in dealt:
        for i in range(len(batch["labels"])):
            kept = batch["attention_mask"][i].bool()
            rows[tuple(batch["input_ids"][i][kept].tolist())] = int(batch["labels"][i])
        assert bool(batch["attention_mask"][:, -1].any())  # trimmed to its own longest row
    originals = {}
    for batch in (short, long):
        for i in range(len(batch["labels"])):
            kept = batch["attention_mask"][i].bool()
            originals[tuple(batch["input_ids"][i][kept].tolist())] = int(batch["labels"][i])
    assert rows == originals  # every example once, with its own label


@pytest.mark.parametrize(("shuffle", "mixed"), [("examples", True), ("batches", False)])
def test_class_sorted_batches_are_mixed_when_training(monkeypatch, shuffle, mixed):
    from hydra_ensembles import training as module

    sorted_batches = []
    for label in range(3):  # class-sorted: every batch holds one class
        batch = text_inputs(batch=4, tokens=6, seed=label)
        sorted_batches.append({**batch, "labels": torch.full((4,), label)})
    seen, original = [], module.loop.Run._loss

    def spy(self, batch):
        seen.append(set(batch["labels"].tolist()))
        return original(self, batch)

    monkeypatch.setattr(module.loop.Run, "_loss", spy)
    config = FineTuneConfig(epochs=2, lr=1e-3, precision="fp32", shuffle=shuffle)
    fine_tune(tiny_bert(layers=1, heads=2), sorted_batches, None, config, progress=False)
    assert any(len(labels) > 1 for labels in seen) == mixed
    first = list(seen)
    seen.clear()
    fine_tune(tiny_bert(layers=1, heads=2), sorted_batches, None, config, progress=False)
    assert seen == first  # seeded: the same batches again


def test_a_fine_tune_records_its_optimizer_steps_since_the_pretrained_weights():
    """3 batches per epoch, 2 epochs: 6 steps; fine-tuning that model again adds a stage; early
    stopping counts the steps up to the epoch it restored."""
    from hydra_ensembles.training import training_summary

    model, seen = tiny_bert(layers=1, heads=2), []
    config = FineTuneConfig(epochs=2, precision="fp32")
    result = fine_tune(model, _data(3), config=config, progress=False, on_epoch=seen.append)
    assert seen == result.history and [r["epoch"] for r in seen] == [0, 1]  # said as each ended
    record = model.config.hydra_training
    assert record["optimizer_steps"] == 6 and record["stages"] == [6] and record["examples"] == 24
    fine_tune(model, _data(2), config=FineTuneConfig(epochs=1, precision="fp32"), progress=False)
    assert model.config.hydra_training["stages"] == [6, 2]
    assert training_summary(model) == "8 optimizer steps (6 + 2)"
    assert training_summary([model, tiny_bert(layers=1, heads=2)]) == "8 optimizer steps (6 + 2)"
    other = tiny_bert(layers=1, heads=2)
    fine_tune(other, _data(3), config=FineTuneConfig(epochs=1, precision="fp32"), progress=False)
    assert training_summary([model, other]) == "3-8 optimizer steps per member"
    stopped = tiny_bert(layers=1, heads=2, init_range=0.1)
    config = FineTuneConfig(epochs=30, lr=1e-2, patience=2, precision="fp32", warmup=0.0)
    result = fine_tune(stopped, _data(3), val=_data(2, seed=50), config=config, progress=False)
    assert result.optimizer_steps == 3 * (result.best_epoch + 1) < 3 * len(result.history)
    assert stopped.config.hydra_training["optimizer_steps"] == result.optimizer_steps


def test_auto_epochs_give_small_data_enough_optimizer_steps():
    from hydra_ensembles.training import auto_epochs

    assert auto_epochs(10) == 10  # 300 texts in batches of 32: 100 steps, not 30
    assert auto_epochs(34) == 3 and auto_epochs(1000) == 3  # larger data: the usual 3
    assert auto_epochs(1) == 20  # at most 20
    assert auto_epochs(10, batches_per_step=2) == 20
