"""The bad-input catalogue: every command refuses bad input with one line on stderr naming what
is wrong, a non-zero exit code, and nothing written at its output path. A pickle where
safetensors are expected is never opened."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    ViTConfig,
    ViTForImageClassification,
)

import hydra_ensembles as he
from hydra_cli import main
from hydra_ensembles.calibration import calibrate
from hydra_ensembles.hashing import config_digest
from hydra_ensembles.loading import load_any
from hydra_ensembles.members import load_member, save_member
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.saving.formats import write_folder_checksums

# refusals, messages and files left whole: what these tests assert is the same in every precision
pytestmark = pytest.mark.same_in_every_precision

TINY = {"hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}


class Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """A workspace of small models, saved models, rankings and data files, good and bad."""
    root = tmp_path_factory.mktemp("errors")
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    model = BertForSequenceClassification(BertConfig(**TINY, num_labels=2))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    BertModel(BertConfig(**TINY)).save_pretrained(root / "base")  # no classifier head
    BertForSequenceClassification(BertConfig(**TINY, num_labels=1)).save_pretrained(root / "one-label")
    tokenizer.save_pretrained(root / "one-label")
    tokenizer.save_pretrained(root / "base")
    cased = json.loads((root / "model" / "tokenizer_config.json").read_text())
    (root / "model-cased-settings.json").write_text(json.dumps({**cased, "do_lower_case": False}))
    vit = ViTForImageClassification(
        ViTConfig(**TINY, image_size=8, patch_size=4, num_channels=1, num_labels=2)
    )
    vit.save_pretrained(root / "vit")

    shutil.copytree(root / "model", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    shutil.copytree(root / "model", root / "pickled")
    (root / "pickled" / "model.safetensors").unlink()
    torch.save({"weights": Evil(root / "MARKER")}, root / "pickled" / "pytorch_model.bin")
    shutil.copytree(root / "model", root / "bad-config")
    config = json.loads((root / "bad-config" / "config.json").read_text())
    (root / "bad-config" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 5}))

    val = {**tokenizer([f"text {i}" for i in range(8)], return_tensors="pt"), "labels": torch.arange(8) % 2}
    calibrate(model, [val], score="msp", set_method="", progress=False)
    model.save_pretrained(root / "calibrated")  # with its calibration in config.json
    tokenizer.save_pretrained(root / "calibrated")
    shutil.copytree(root / "calibrated", root / "edited-calibration")  # edited by hand
    saved = json.loads((root / "calibrated" / "config.json").read_text())
    saved["hydra_calibration"]["flag"]["threshold"] = -1.0  # would flag every input
    (root / "edited-calibration" / "config.json").write_text(json.dumps(saved))
    shutil.copytree(root / "calibrated", root / "bad-calibration")  # its checksum recomputed
    flag = {**saved["hydra_calibration"]["flag"], "threshold": 0.5}
    saved["hydra_calibration"] = _resigned({**saved["hydra_calibration"], "flag": flag, "temperature": -1})
    (root / "bad-calibration" / "config.json").write_text(json.dumps(saved))
    shutil.copytree(root / "calibrated", root / "other-weights-calibration")
    saved["hydra_calibration"] = _resigned(
        {**saved["hydra_calibration"], "temperature": 1.0, "model_sha256": "0" * 64}
    )
    (root / "other-weights-calibration" / "config.json").write_text(json.dumps(saved))

    write_folder_checksums(root / "calibrated")  # as finetune writes its folder
    for name in ("tuned-tokenizer-swapped", "tuned-classes-swapped", "tuned-file-added"):
        shutil.copytree(root / "calibrated", root / name)
    shutil.copy(
        root / "model-cased-settings.json", root / "tuned-tokenizer-swapped" / "tokenizer_config.json"
    )
    hf = json.loads((root / "tuned-classes-swapped" / "config.json").read_text())
    hf["id2label"] = {"0": "LABEL_1", "1": "LABEL_0"}
    (root / "tuned-classes-swapped" / "config.json").write_text(json.dumps(hf))
    (root / "tuned-file-added" / "added_tokens.json").write_text('{"goal": 0}')
    shutil.copytree(root / "calibrated", root / "tuned-checksums-aliased")  # re-signed by hand
    record = json.loads((root / "tuned-checksums-aliased" / "checksums.json").read_text())
    aliases = {
        f"./{'.//' * i}model.safetensors": record["files_sha256"]["model.safetensors"] for i in range(50)
    }
    record["files_sha256"] = {**record["files_sha256"], **aliases, "../train.csv": "0" * 64}
    record["config_sha256"] = config_digest(record)
    (root / "tuned-checksums-aliased" / "checksums.json").write_text(json.dumps(record))

    for name, change in (
        ("huge-config", {"intermediate_size": 10**12}),  # would allocate 96 TB before loading
        ("hub-kernel-config", {"attn_implementation": "kernels-community/flash-attn"}),  # hub code
    ):
        shutil.copytree(root / "model", root / name)
        (root / name / "config.json").write_text(json.dumps({**config, **change}))

    shutil.copytree(root / "model", root / "fewer-layers")
    (root / "fewer-layers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    shutil.copytree(root / "model", root / "wider")
    (root / "wider" / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    broken = BertForSequenceClassification(BertConfig(**TINY, num_labels=2))
    with torch.no_grad():
        broken.bert.encoder.layer[0].attention.self.query.weight[0, 0] = float("inf")
    broken.save_pretrained(root / "inf-weights")
    tokenizer.save_pretrained(root / "inf-weights")

    loaded = load_any(str(root / "model"))
    loaded.config.id2label, loaded.config.label2id = {0: "money", 1: "sport"}, {"money": 0, "sport": 1}
    he.fuse(loaded, [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2, 3]})]).save_pretrained(root / "hydra")
    tokenizer.save_pretrained(root / "hydra-tokenizer-edited")
    he.fuse(loaded, [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2, 3]})]).save_pretrained(
        root / "hydra-tokenizer-edited"
    )  # the tokenizer saved first: its files are in the model's checksums
    vocab = root / "hydra-tokenizer-edited" / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"[UNK]"', '"[UNKNOWN]"', 1))
    shutil.copytree(root / "hydra", root / "hydra-tampered")
    weights = root / "hydra-tampered" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    save_member(he.prune(loaded, he.HeadSet({0: [0, 1, 2]})), root / "member")
    pets = he.prune(loaded, he.HeadSet({0: [0, 1]}))
    pets.config.id2label, pets.config.label2id = {0: "cat", 1: "dog"}, {"cat": 0, "dog": 1}
    save_member(pets, root / "member-pets")
    shutil.copytree(root / "member", root / "member-edited")
    file = root / "member-edited" / "member_config.json"
    meta = json.loads(file.read_text())
    meta["config"]["num_attention_heads"] = 3
    file.write_text(json.dumps(meta))
    shutil.copytree(root / "member", root / "member-broken")
    (root / "member-broken" / "member_config.json").write_text('{"format": "hydra-ensembles/mem')
    _saved_ensembles(root, loaded, tokenizer)
    shutil.copytree(root / "model", root / "model-cased")  # the same weights, another tokenizer
    settings = json.loads((root / "model-cased" / "tokenizer_config.json").read_text())
    settings["do_lower_case"] = False  # "Goal" and "goal" become different ids
    (root / "model-cased" / "tokenizer_config.json").write_text(json.dumps(settings))

    circuit = {
        "method": "circuit",
        "objective": "acc",
        "heads_per_layer": [4, 4],
        "base_score": 1.0,
        "removed": [[0, 1], [1, 2], [0, 3]],
        "scores": [1.0, 1.0, 1.0],
    }
    (root / "circuit.json").write_text(json.dumps(circuit))
    (root / "circuit-3heads.json").write_text(json.dumps({**circuit, "heads_per_layer": [3, 3]}))
    (root / "circuit-out-of-range.json").write_text(json.dumps({**circuit, "removed": [[0, 9]]}))
    (root / "circuit-twice.json").write_text(json.dumps({**circuit, "removed": [[0, 1], [0, 1]]}))
    (root / "truncated.json").write_text('{"method": "circ')
    (root / "not-scores.json").write_text('{"method": "magic"}')
    (root / "list.json").write_text("[1, 2, 3]")
    heads = {
        "heads-truncated.json": '{"0": [0, 1',
        "heads-layer.json": '{"9": [0]}',
        "heads-head.json": '{"0": [7]}',
        "heads-negative.json": '{"0": [-1]}',
        "heads-duplicate.json": '{"0": [1, 1]}',
        "heads-empty-list.json": "[]",
        "heads-numbers.json": "[1, 2]",
    }
    for name, text in heads.items():
        (root / name).write_text(text)

    rows = [f"goal match team score {i},sport" for i in range(6)] + [
        f"bank profit {i},money" for i in range(6)
    ]
    (root / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    (root / "header-only.csv").write_text("text,label\n")
    (root / "no-label-column.csv").write_text("text\nhello\n")
    (root / "ids-outside.csv").write_text("text,label\na,0\nb,4\n")
    (root / "unknown-class.csv").write_text("text,label\na,sport\nb,weather\n")
    (root / "latin1.csv").write_bytes("text,label\ncaf\xe9,sport\n".encode("latin-1"))
    (root / "empty-text.csv").write_text('text,label\n"",sport\nb,money\n')
    (root / "negative.csv").write_text("text,label\na,-1\nb,0\n")
    (root / "bad.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label"\n')
    (root / "unlabelled.csv").write_text("text\nrecipe with flour\nanother recipe\n")
    (root / "nan-label.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": NaN}\n')
    (root / "bool-labels.jsonl").write_text('{"text": "a", "label": true}\n{"text": "b", "label": false}\n')
    (root / "nested-text.jsonl").write_text(
        '{"text": {"body": "a"}, "label": 0}\n{"text": "b", "label": 1}\n'
    )
    for name in ("cat", "dog"):  # an image folder whose class folders hold folders
        (root / "nested-images" / name / "more").mkdir(parents=True)
    (root / "nan-text-label.csv").write_text("text,label\na,sport\nb,nan\n")
    (root / "shifted.csv").write_text("text,label\ngoal match,sport\nbank, shares and profit,money\n")
    (root / "one-class.csv").write_text("text,label\n" + "".join(f"goal {i},sport\n" for i in range(8)))
    (root / "one-class-id.csv").write_text("text,label\n" + "".join(f"goal {i},1\n" for i in range(8)))
    (root / "absurd-id.csv").write_text("text,label\na,0\nb,99999999999\n")
    (root / "ids-and-names.csv").write_text("text,label\na,0\nb,sport\n")
    (root / "fraction.csv").write_text("text,label\na,0\nb,1.7\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2], "label": ["sport", "money"]}), root / "int-text.parquet")
    pq.write_table(pa.table({"body": ["goal", "bank"], "label": [1, 0]}), root / "body.parquet")
    grey = np.zeros((4, 8, 8), np.float32)
    np.savez(root / "minus-one.npz", x=grey, y=np.array([0, 1, -1, 1]))
    np.savez(root / "fraction.npz", x=grey, y=np.array([0, 1, 1.7, 1]))
    np.savez(root / "pixels-0-255-float.npz", x=grey + 37.0, y=np.array([0, 1, 0, 1]))
    np.savez(root / "uint16.npz", x=np.full((4, 8, 8), 4000, np.uint16), y=np.array([0, 1, 0, 1]))
    (root / "zero-bytes.npz").write_bytes(b"")
    np.savez(root / "whole.npz", x=grey, y=np.array([0, 1, 0, 1]))
    (root / "truncated.npz").write_bytes((root / "whole.npz").read_bytes()[:300])
    nan = np.random.default_rng(0).random((4, 1, 8, 8)).astype(np.float32)
    nan[1, 0, 2, 2] = np.nan
    np.savez(root / "nan.npz", x=nan, y=np.array([0, 1, 0, 1]))
    np.savez(root / "flat.npz", x=np.zeros((4, 8), np.float32), y=np.array([0, 1, 0, 1]))
    np.savez(root / "images.npz", x=np.zeros((4, 8, 8), np.float32), y=np.array([0, 1, 0, 1]))
    (root / "a-file").write_text("not a directory")
    (root / "used").mkdir()
    (root / "used" / "notes.txt").write_text("someone else's file")
    (root / "an-output-dir").mkdir()
    (root / "someones-folder").mkdir()
    (root / "tuned-planted.checkpoint").symlink_to(root / "someones-folder", target_is_directory=True)
    (root / "one-row.csv").write_text("text,label\nbank shares rose,1\n")
    absent = "text,label\nbank 0,0\n" + "".join(f"goal {i},1\n" for i in range(7))
    (root / "class-0-only-first.csv").write_text(absent)  # class 0 at an even position only
    return root


def _resigned(record: dict) -> dict:
    """A calibration record with its own checksum recomputed (an edit that keeps it well formed)."""
    from hydra_ensembles.calibration.calibration import RECORD_DIGEST
    from hydra_ensembles.hashing import json_digest

    body = {k: v for k, v in record.items() if k != RECORD_DIGEST}
    return {**body, RECORD_DIGEST: json_digest(body)}


def _saved_ensembles(root, model, tokenizer) -> None:
    """A calibrated saved ensemble of two members, and copies edited after saving: the index's
    temperature raised, one member named twice, a member folder swapped for another member."""
    from hydra_ensembles.calibration import calibrate
    from hydra_ensembles.members import DeepEnsemble

    members = [he.prune(model, he.HeadSet({0: [0, 1]})), he.prune(model, he.HeadSet({1: [2, 3]}))]
    ensemble = DeepEnsemble(members)
    batch = dict(tokenizer(["a text", "another one", "third", "fourth"], padding=True, return_tensors="pt"))
    labelled = {**batch, "labels": torch.tensor([0, 1, 0, 1])}
    calibrate(ensemble, [labelled], score="msp", set_method="", progress=False)
    tokenizer.save_pretrained(root / "ens")  # first: the index's checksums cover it
    ensemble.save_pretrained(root / "ens")
    for name in ("ens-edited", "ens-twice", "ens-swapped", "ens-tokenizer-edited"):
        shutil.copytree(root / "ens", root / name)
    vocab = root / "ens-tokenizer-edited" / "tokenizer.json"
    vocab.write_text(vocab.read_text().replace('"[UNK]"', '"[UNKNOWN]"', 1))
    index = root / "ens-edited" / "ensemble_config.json"
    saved = json.loads(index.read_text())
    saved["calibration"]["temperature"] = 50.0
    index.write_text(json.dumps(saved))
    index = root / "ens-twice" / "ensemble_config.json"
    saved = json.loads(index.read_text())
    saved["members"] = ["member-0", "member-0"]
    index.write_text(json.dumps(saved))
    shutil.rmtree(root / "ens-swapped" / "member-1")
    shutil.copytree(root / "ens" / "member-0", root / "ens-swapped" / "member-1")


def finetune(w, *extra, out="tuned"):
    return ["finetune", str(w / "model"), "--data", str(w / "train.csv"), *extra, "--out", str(w / out)]


def score(w, *extra, data="train.csv", out="out.json", model="model"):
    return ["score", str(w / model), "--data", str(w / data), "--out", str(w / out), *extra]


def build(w, *extra, scores="circuit.json", out="built", model="model"):
    return ["build", str(w / model), "--scores", str(w / scores), "--out", str(w / out), *extra]


def fuse(w, heads, out="fused", model="model"):
    return ["fuse", str(w / model), "--heads", str(w / heads), "--out", str(w / out)]


def evaluate(w, *extra, method="model", data="train.csv", out="report"):
    return ["eval", "--method", f"m={w / method}", "--id-data", str(w / data), "--out", str(w / out), *extra]


def predict(w, *extra, model="model", data="train.csv", out="p.csv"):
    return ["predict", str(w / model), "--data", str(w / data), "--out", str(w / out), *extra]


def export(w, model="hydra", out="onnx"):
    return ["export", str(w / model), "--format", "onnx", "--out", str(w / out)]


def zero_shot(w):
    data = ["--data", str(w / "train.csv"), "--ood-data", str(w / "unlabelled.csv")]
    return ["zero-shot", str(w / "model"), *data, "--out", str(w / "zs")]


HEADS_PER_LAYER = ("--heads-per-layer", "2")

# (id, argv builder, message fragment, output path that must not appear)
CASES = [
    # models: missing, damaged, tampered, unsupported, contradicting
    ("info-missing-model", lambda w: ["info", "/nonexistent/model"], "no model at", None),
    ("score-missing-model", lambda w: score(w, model="no-such-model"), "no model at", "out.json"),
    ("truncated-safetensors", lambda w: score(w, model="truncated"), "cannot read the weights", "out.json"),
    ("pickle-instead-of-safetensors", lambda w: score(w, model="pickled"), "model.safetensors", "out.json"),
    ("config-wrong-head-count", lambda w: score(w, model="bad-config"), "heads", "out.json"),
    ("tampered-hydra-weights", lambda w: evaluate(w, method="hydra-tampered"), "checksum", "report"),
    ("edited-member-config", lambda w: evaluate(w, method="member-edited"), "modified", "report"),
    (
        "edited-tokenizer-of-hydra",
        lambda w: evaluate(w, method="hydra-tokenizer-edited"),
        "tokenizer.json was modified after saving",
        "report",
    ),
    (  # a folder finetune wrote, changed after saving
        "finetuned-tokenizer-swapped",
        lambda w: predict(w, model="tuned-tokenizer-swapped"),
        "tokenizer_config.json was modified after saving",
        "p.csv",
    ),
    (
        "finetuned-classes-swapped",
        lambda w: predict(w, model="tuned-classes-swapped"),
        "config.json was mod",
        "p.csv",
    ),
    (  # a re-signed record naming the weights under other names, or files outside the folder
        "finetuned-checksums-name-aliases",
        lambda w: predict(w, model="tuned-checksums-aliased"),
        "not the plain name of a file",
        "p.csv",
    ),
    (
        "finetuned-loader-file-added",
        lambda w: predict(w, model="tuned-file-added"),
        "was added after",
        "p.csv",
    ),
    ("config-of-huge-sizes", lambda w: predict(w, model="huge-config"), "config.json describes", "p.csv"),
    (
        "config-naming-a-hub-kernel",
        lambda w: predict(w, model="hub-kernel-config"),
        "would load code",
        "p.csv",
    ),
    ("broken-member-json", lambda w: evaluate(w, method="member-broken"), "not valid JSON", "report"),
    # a saved ensemble edited or mixed after saving
    ("ensemble-index-edited", lambda w: predict(w, model="ens-edited"), "own checksum", "p.csv"),
    ("ensemble-names-a-member-twice", lambda w: predict(w, model="ens-twice"), "a member twice", "p.csv"),
    ("ensemble-member-swapped", lambda w: predict(w, model="ens-swapped"), "is not the member", "p.csv"),
    (
        "ensemble-tokenizer-edited",
        lambda w: predict(w, model="ens-tokenizer-edited"),
        "tokenizer.json was modified after saving",
        "p.csv",
    ),
    (  # a fused model answers for several members: it is no member of an explicit ensemble
        "ensemble-of-a-hydra-model-and-a-classifier",
        lambda w: ["predict", f"{w / 'hydra'},{w / 'model'}", *predict(w)[2:]],
        "takes single models",
        "p.csv",
    ),
    (  # one input would reach the members as different token ids
        "ensemble-of-differently-tokenized-members",
        lambda w: ["predict", f"{w / 'model'},{w / 'model-cased'}", *predict(w)[2:]],
        "different tokenizers",
        "p.csv",
    ),
    ("calibration-edited-by-hand", lambda w: predict(w, model="edited-calibration"), "own checksum", "p.csv"),
    (
        "malformed-saved-calibration",
        lambda w: predict(w, model="bad-calibration"),
        "temperature must be positive",
        "p.csv",
    ),
    (
        "finetune-flag-score-a-single-model-lacks",
        lambda w: finetune(w, "--val-data", str(w / "train.csv"), "--flag-score", "mutual_information"),
        "is a single model and has none",
        "tuned",
    ),
    (  # refused before any training: no checkpoint is left behind
        "finetune-flag-score-of-members-disagreement",
        lambda w: finetune(w, "--val-data", str(w / "train.csv"), "--flag-score", "mds_disagreement"),
        "is a single model and has none",
        "tuned.checkpoint",
    ),
    # calibration data: what each part of a calibration needs, checked before any work
    (
        "calibrate-on-one-class",
        lambda w: [
            "calibrate",
            str(w / "calibrated"),
            "--val-data",
            str(w / "one-class-id.csv"),
            "--out",
            str(w / "c"),
        ],
        "of one class",
        "c",
    ),
    (
        "build-calibrated-on-one-class",
        lambda w: build(w, "--num-pruned", "1", "--val-data", str(w / "one-class-id.csv")),
        "of one class",
        "built",
    ),
    (
        "predict-calibrated-on-one-class",
        lambda w: predict(w, "--val-data", str(w / "one-class-id.csv")),
        "of one class",
        "p.csv",
    ),
    (
        "predict-calibrated-on-one-row",
        lambda w: predict(w, "--val-data", str(w / "one-row.csv")),
        "at least 2 labelled validation inputs",
        "p.csv",
    ),
    (
        "per-class-sets-with-a-class-absent",
        lambda w: [
            *["calibrate", str(w / "calibrated"), "--val-data", str(w / "class-0-only-first.csv")],
            *["--set-classwise", "--out", str(w / "c")],
        ],
        "none of",
        "c",
    ),
    (
        "build-trunk-of-every-layer",
        lambda w: build(w, "--num-pruned", "1", "--shared-layers", "2"),
        "shared_layers must be in [0, 1]",
        "built",
    ),
    (
        "calibration-of-other-weights",
        lambda w: predict(w, model="other-weights-calibration"),
        "fit on other weights",
        "p.csv",
    ),
    (
        "flag-score-other-than-the-saved-calibration",
        lambda w: predict(w, "--flag-score", "energy", model="calibrated"),
        "saved calibration flags on msp keeping 95%",
        "p.csv",
    ),
    ("num-labels-contradicts-head", lambda w: score(w, "--num-labels", "5"), "contradicts", "out.json"),
    (
        "config-fewer-layers-than-weights",
        lambda w: score(w, model="fewer-layers"),
        "num_hidden_layers=1",
        "out.json",
    ),
    (
        "config-other-width-than-weights",
        lambda w: score(w, model="wider"),
        "do not belong together",
        "out.json",
    ),
    ("weights-inf", lambda w: score(w, model="inf-weights"), "NaN or Inf", "out.json"),
    (  # checked before any training: the calibration's sets need two validation inputs
        "finetune-one-validation-input",
        lambda w: finetune(w, "--val-data", str(w / "one-row.csv")),
        "at least 2 labelled validation inputs",
        "tuned.checkpoint",
    ),
    (
        "finetune-diverges",
        lambda w: [
            "finetune",
            str(w / "model"),
            "--data",
            str(w / "train.csv"),
            "--lr",
            "1e30",
            "--out",
            str(w / "ft"),
        ],
        "diverged",
        "ft",
    ),
    ("base-model-random-head", lambda w: score(w, model="base"), "no trained classifier head", "out.json"),
    ("build-on-random-head", lambda w: build(w, *HEADS_PER_LAYER, model="base"), "finetune", "built"),
    ("images-to-text-model", lambda w: score(w, data="images.npz"), "holds images", "out.json"),
    ("text-to-image-model", lambda w: score(w, model="vit"), "holds texts", "out.json"),
    ("hydra-without-tokenizer", lambda w: predict(w, model="hydra"), "--tokenizer", "p.csv"),
    # export: never a graph that differs from the model, never into the model's folder
    ("export-tampered-weights", lambda w: export(w, model="hydra-tampered"), "checksum", "onnx"),
    ("export-into-the-model", lambda w: export(w, out="hydra/onnx"), "lies inside the input", "hydra/onnx"),
    ("export-random-head", lambda w: export(w, model="base"), "no trained classifier head", "onnx"),
    # head-set files
    ("heads-file-missing", lambda w: fuse(w, "no-heads.json"), "does not exist", "fused"),
    ("heads-truncated-json", lambda w: fuse(w, "heads-truncated.json"), "not valid JSON", "fused"),
    ("heads-layer-out-of-range", lambda w: fuse(w, "heads-layer.json"), "layer", "fused"),
    ("heads-head-out-of-range", lambda w: fuse(w, "heads-head.json"), "head", "fused"),
    ("heads-negative", lambda w: fuse(w, "heads-negative.json"), "heads-negative.json", "fused"),
    ("heads-duplicate", lambda w: fuse(w, "heads-duplicate.json"), "heads-duplicate.json", "fused"),
    ("heads-empty-list", lambda w: fuse(w, "heads-empty-list.json"), "head set", "fused"),
    ("heads-not-objects", lambda w: fuse(w, "heads-numbers.json"), "head set", "fused"),
    # ranking files
    ("scores-missing", lambda w: build(w, *HEADS_PER_LAYER, scores="none.json"), "does not exist", "built"),
    ("scores-truncated", lambda w: build(w, *HEADS_PER_LAYER, scores="truncated.json"), "JSON", "built"),
    ("scores-not-ours", lambda w: build(w, *HEADS_PER_LAYER, scores="not-scores.json"), "score", "built"),
    (
        "scores-other-model",
        lambda w: build(w, *HEADS_PER_LAYER, scores="circuit-3heads.json"),
        "[3, 3]",
        "built",
    ),
    (
        "scores-head-out-of-range",
        lambda w: build(w, *HEADS_PER_LAYER, scores="circuit-out-of-range.json"),
        "(0, 9)",
        "built",
    ),
    (
        "scores-head-twice",
        lambda w: build(w, *HEADS_PER_LAYER, scores="circuit-twice.json"),
        "twice",
        "built",
    ),
    # counts
    ("members-zero", lambda w: build(w, *HEADS_PER_LAYER, "--members", "0"), "--members", "built"),
    ("build-keeps-no-head", lambda w: build(w, "--heads-per-layer", "0"), "at least one head", "built"),
    ("bootstrap-untrained", lambda w: build(w, *HEADS_PER_LAYER, "--bootstrap"), "--fine-tune", "built"),
    ("build-prunes-every-head", lambda w: build(w, "--num-pruned", "8"), "at least one of the 8", "built"),
    (
        "pool-smaller-than-pruned",
        lambda w: build(w, "--num-pruned", "3", "--pool-size", "2"),
        "at least",
        "built",
    ),
    ("pool-beyond-ranking", lambda w: build(w, "--num-pruned", "2", "--pool-size", "7"), "ranks 3", "built"),
    ("prune-beyond-ranking", lambda w: build(w, "--heads-per-layer", "1"), "ranks", "built"),
    ("budget-beyond-heads", lambda w: score(w, "--objective", "acc", "--budget", "99"), "budget", "out.json"),
    (
        "taylor-keeps-too-many",
        lambda w: score(w, "--method", "taylor", "--heads-per-layer", "9"),
        "heads",
        "out.json",
    ),
    ("batch-size-zero", lambda w: score(w, "--batch-size", "0"), "--batch-size", "out.json"),
    ("max-length-beyond-positions", lambda w: score(w, "--max-length", "600"), "512 positions", "out.json"),
    (
        "checkpoint-holds-a-list",
        lambda w: score(w, "--objective", "acc", "--budget", "2", "--checkpoint", str(w / "list.json")),
        "not a circuit checkpoint",
        "out.json",
    ),
    ("keep-outside-0-1", lambda w: predict(w, "--keep", "1.5"), "--keep", "p.csv"),
    ("lr-negative", lambda w: build(w, *HEADS_PER_LAYER, "--lr", "-1"), "--lr", "built"),
    (  # weights finite but so large that the model predicts NaN: nothing is saved
        "finetune-diverges-to-huge-weights",
        lambda w: finetune(w, "--lr", "1e30", "--epochs", "1"),
        "diverged",
        "tuned",
    ),
    # data
    ("data-empty", lambda w: score(w, data="header-only.csv"), "no rows", "out.json"),
    ("data-missing-column", lambda w: score(w, data="no-label-column.csv"), "no column", "out.json"),
    ("labels-outside-num-labels", lambda w: score(w, data="ids-outside.csv"), "outside", "out.json"),
    (
        "class-unknown-to-model",
        lambda w: evaluate(w, method="hydra", data="unknown-class.csv"),
        "weather",
        "report",
    ),
    ("data-not-utf8", lambda w: score(w, data="latin1.csv"), "UTF-8", "out.json"),
    ("data-empty-string", lambda w: score(w, data="empty-text.csv"), "empty", "out.json"),
    ("data-negative-label", lambda w: score(w, data="negative.csv"), ">= 0", "out.json"),
    ("data-bad-jsonl-line", lambda w: score(w, data="bad.jsonl"), "line 2", "out.json"),
    ("data-missing-file", lambda w: score(w, data="missing.csv"), "does not exist", "out.json"),
    (
        "data-unknown-name",
        lambda w: ["score", str(w / "model"), "--data", "no-such-set", "--out", str(w / "o.json")],
        "unknown data",
        "o.json",
    ),
    ("data-nan-images", lambda w: score(w, model="vit", data="nan.npz"), "NaN", "out.json"),
    # labels (one parser for every format)
    ("label-nan", lambda w: score(w, data="nan-label.jsonl"), "no 'label'", "out.json"),
    ("label-boolean", lambda w: score(w, data="bool-labels.jsonl"), "a boolean", "out.json"),
    ("one-class-model", lambda w: predict(w, model="one-label"), "needs at least two", "p.csv"),
    ("text-is-an-object", lambda w: score(w, data="nested-text.jsonl"), "is a dict, not a text", "out.json"),
    (
        "image-folder-nested",
        lambda w: score(w, model="vit", data="nested-images"),
        "holds folders",
        "out.json",
    ),
    ("label-nan-text", lambda w: score(w, data="nan-text-label.csv"), "no 'label'", "out.json"),
    ("label-shifted-by-a-comma", lambda w: score(w, data="shifted.csv"), "line 3: 3 fields", "out.json"),
    ("label-absurd-class-id", lambda w: score(w, data="absurd-id.csv"), "implausible", "out.json"),
    ("labels-ids-and-names", lambda w: score(w, data="ids-and-names.csv"), "mixes class ids", "out.json"),
    ("label-fraction", lambda w: score(w, data="fraction.csv"), "not a class id", "out.json"),
    (
        "train-on-one-class",
        lambda w: ["finetune", str(w / "base"), "--data", str(w / "one-class.csv"), "--out", str(w / "ft")],
        "at least two classes",
        "ft",
    ),
    (
        "build-train-on-one-class",
        lambda w: build(w, "--num-pruned", "1", "--fine-tune", "--data", str(w / "one-class-id.csv")),
        "at least two classes",
        "built",
    ),
    (
        "zero-shot-empty-class",
        lambda w: [*zero_shot(w), "--labels", "sport,money,"],
        "must not be empty",
        "zs",
    ),
    ("zero-shot-two-fields", lambda w: [*zero_shot(w), "--template", "{} and {}"], "exactly one", "zs"),
    ("zero-shot-named-field", lambda w: [*zero_shot(w), "--template", "{topic}"], "exactly one", "zs"),
    # columns
    (
        "parquet-text-not-text",
        lambda w: score(w, data="int-text.parquet"),
        "holds int64, not text",
        "out.json",
    ),
    (
        "text-column-mistyped",
        lambda w: score(w, "--text-column", "bdoy", data="body.parquet"),
        "no column 'bdoy'",
        "out.json",
    ),
    (
        "label-column-mistyped",
        lambda w: score(w, "--text-column", "body", "--label-column", "lable", data="body.parquet"),
        "no label column 'lable'",
        "out.json",
    ),
    ("csv-text-column-mistyped", lambda w: score(w, "--text-column", "txt"), "no column", "out.json"),
    # images
    ("npz-label-minus-one", lambda w: score(w, model="vit", data="minus-one.npz"), ">= 0", "out.json"),
    (
        "npz-label-fraction",
        lambda w: score(w, model="vit", data="fraction.npz"),
        "not a class id",
        "out.json",
    ),
    (
        "npz-pixels-out-of-range",
        lambda w: score(w, model="vit", data="pixels-0-255-float.npz"),
        "[0, 1]",
        "out.json",
    ),
    ("npz-uint16-pixels", lambda w: score(w, model="vit", data="uint16.npz"), "uint8", "out.json"),
    ("npz-zero-bytes", lambda w: score(w, model="vit", data="zero-bytes.npz"), "not a readable", "out.json"),
    ("npz-truncated", lambda w: score(w, model="vit", data="truncated.npz"), "not a readable", "out.json"),
    ("data-wrongly-shaped-images", lambda w: score(w, model="vit", data="flat.npz"), "(N, H, W)", "out.json"),
    (
        "val-data-unlabelled",
        lambda w: predict(w, "--val-data", str(w / "unlabelled.csv")),
        "no column",
        "p.csv",
    ),
    ("ood-without-kind", lambda w: evaluate(w, "--ood", f"x={w / 'unlabelled.csv'}"), "near|far", "report"),
    # paths
    ("out-under-a-file", lambda w: score(w, out="a-file/out.json"), "is a file", None),
    (
        "out-unwritable",
        lambda w: ["score", str(w / "model"), "--data", str(w / "train.csv"), "--out", "/proc/hydra/o.json"],
        "cannot write",
        None,
    ),
    ("out-is-a-directory", lambda w: score(w, out="an-output-dir"), "directory", None),
    ("bootstrap-too-few", lambda w: evaluate(w, "--bootstrap", "1"), "at least 40 resamples", "report"),
    (
        "method-named-twice",
        lambda w: [*evaluate(w), "--method", f"m={w / 'hydra'}"],
        "--method names 'm' twice",
        "report",
    ),
    (
        "ood-named-twice",
        lambda w: evaluate(w, "--ood", f"x={w / 'unlabelled.csv'}:far", "--ood", f"x={w / 'train.csv'}:near"),
        "--ood names 'x' twice",
        "report",
    ),
    ("out-bad-suffix", lambda w: predict(w, out="p.txt"), ".csv or .jsonl", "p.txt"),
    ("plot-without-val-data", lambda w: predict(w, "--plot", str(w / "s.png")), "give --val-data", "p.csv"),
    ("plot-bad-suffix", lambda w: predict(w, "--plot", str(w / "s.pdf")), ".png", "p.csv"),
    ("build-into-foreign-dir", lambda w: build(w, *HEADS_PER_LAYER, out="used"), "not empty", "used/hydra"),
    ("eval-report-is-a-file", lambda w: evaluate(w, out="a-file"), "is a file", None),
    ("eval-into-the-users-folder", lambda w: evaluate(w, out="used"), "did not write", "used/report.md"),
    (
        "bench-batch-size-zero",
        lambda w: ["bench", str(w / "model"), "--batch-sizes", "8,0", "--out", str(w / "b")],
        "--batch-sizes",
        "b",
    ),
    (
        "bench-tokens-beyond-positions",
        lambda w: [
            "bench",
            str(w / "model"),
            "--tokens",
            "600",
            "--heads-per-layer",
            "2",
            "--out",
            str(w / "b"),
        ],
        "exceeds the model's 512 positions",
        "b",
    ),
    ("export-opset-not-written", lambda w: [*export(w), "--opset", "7"], "opset", "onnx"),
    (
        "bench-unknown-device",
        lambda w: ["bench", str(w / "model"), "--device", "foo", "--out", str(w / "b")],
        "not a device",
        "b",
    ),
    (
        "models-name-other-classes",
        lambda w: [*evaluate(w, method="hydra"), "--method", f"pets={w / 'member-pets'}"],
        "different classes",
        "report",
    ),
]

# outputs that would destroy an input: (id, argv builder, fragment, the input that must stay intact)
CLOBBERING = [
    (
        "predict-over-its-data",
        lambda w: predict(w, "--labelled", out="train.csv"),
        "is the input",
        "train.csv",
    ),
    ("score-into-the-model", lambda w: score(w, out="model/config.json"), "lies inside the input", "model"),
    (
        "fuse-over-the-model",
        lambda w: [*fuse(w, "heads-good.json", out="model"), "--overwrite"],
        "is the input",
        "model",
    ),
    (
        "build-over-the-scores",
        lambda w: build(w, *HEADS_PER_LAYER, out="circuit.json"),
        "is the input",
        "circuit.json",
    ),
    (
        "eval-report-inside-a-model",
        lambda w: evaluate(w, method="hydra", out="hydra/report"),
        "lies inside",
        "hydra",
    ),
    (  # every input option is guarded, the training data and OOD validation data of eval too
        "eval-report-over-its-training-data",
        lambda w: evaluate(w, "--train-data", str(w / "sub"), out="sub"),
        "is the input",
        "sub",
    ),
    (
        "out-contains-the-data",
        lambda w: predict(w, data="sub/data.csv", out="sub"),
        "contains the input",
        "sub",
    ),
    (
        "out-through-a-symlink",
        lambda w: predict(w, "--labelled", out="link-to-train.csv"),
        "is the input",
        "train.csv",
    ),
    (
        "checkpoint-is-out",
        lambda w: score(w, "--checkpoint", str(w / "ck.json"), out="ck.json"),
        "overlaps",
        None,
    ),
    (
        "ood-spec-is-out",
        lambda w: evaluate(w, "--ood", f"x={w / 'unlabelled.csv'}:far", out="unlabelled.csv"),
        "is the input",
        "unlabelled.csv",
    ),
    (  # the checkpoint folder beside the output is never created or written through a link
        "finetune-checkpoint-is-a-planted-link",
        lambda w: finetune(w, out="tuned-planted"),
        "is a symbolic link, not a folder hydra-ens made",
        "someones-folder",
    ),
    (  # --overwrite replaces a folder the command wrote, never one holding the user's own files
        "finetune-overwrite-onto-a-users-folder",
        lambda w: [*finetune(w, out="used"), "--overwrite"],
        "did not write",
        "used",
    ),
    (
        "export-overwrite-onto-a-users-folder",
        lambda w: [*export(w, out="used"), "--overwrite"],
        "did not write",
        "used",
    ),
    (  # a link planted where the output's lock goes must not make the lock truncate its target
        "lock-file-is-a-planted-link",
        lambda w: predict(w, "--labelled", out="planted/p.csv"),
        "is a symbolic link",
        "victim.txt",
    ),
]


def run(argv: list[str]) -> int:
    """``hydra-ens ARGV``'s exit code (argparse exits by SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def said(err: str) -> list[str]:
    """The lines hydra-ens wrote on stderr (its errors and warnings)."""
    return [line for line in err.splitlines() if line.startswith("hydra-ens")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_writes_nothing(w, case, capsys):
    _, argv, fragment, out = case
    code = run(argv(w))
    err = capsys.readouterr().err
    lines = said(err)
    assert code == 2, err  # a refusal, never an internal error (exit 1)
    assert "Traceback" not in err and len(lines) == 1 and "internal error" not in lines[0], err
    if fragment:
        assert fragment in lines[0], lines[0]
    if out:
        assert not (w / out).exists()
    assert not (w / "MARKER").exists()  # no pickle was ever opened


def _digest(path):
    import hashlib

    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()


@pytest.mark.parametrize("case", CLOBBERING, ids=[c[0] for c in CLOBBERING])
def test_an_output_never_replaces_or_enters_an_input(w, case, capsys):
    """Every command refuses, before any work, an output that is, contains or lies inside one of
    its inputs (symbolic links followed), or that overlaps another output; the input is intact."""
    _, argv, fragment, kept = case
    (w / "heads-good.json").write_text('[{"0": [0, 1]}, {"1": [1, 2]}]')
    (w / "sub").mkdir(exist_ok=True)
    (w / "sub" / "data.csv").write_text((w / "train.csv").read_text())
    if not (w / "link-to-train.csv").exists():
        (w / "link-to-train.csv").symlink_to(w / "train.csv")
    (w / "victim.txt").write_text("a file the user cares about\n")
    (w / "planted").mkdir(exist_ok=True)
    if not (w / "planted" / ".p.csv.lock").is_symlink():
        (w / "planted" / ".p.csv.lock").symlink_to(w / "victim.txt")
    before = _digest(w / kept) if kept else None
    code = run(argv(w))
    lines = said(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines
    if kept:
        assert _digest(w / kept) == before
    assert not (w / "ck.json").exists()


def test_the_catalogue_is_large():
    assert len(CASES) >= 40


def test_finished_model_outputs_are_not_replaced_without_overwrite(w, capsys):
    out = w / "fused-once"
    good = w / "heads-good.json"
    good.write_text('[{"0": [0, 1]}, {"1": [1, 2]}]')
    assert main(["fuse", str(w / "model"), "--heads", str(good), "--out", str(out)]) == 0
    stamp = (out / "hydra_config.json").stat().st_mtime_ns
    assert main(["fuse", str(w / "model"), "--heads", str(good), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "hydra_config.json").stat().st_mtime_ns == stamp
    assert main(["fuse", str(w / "model"), "--heads", str(good), "--out", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("planted", ["symlink", "fifo", "foreign-folder"])
def test_build_overwrite_never_writes_through_what_is_planted_at_its_staging_folder(w, capsys, planted):
    """``build --overwrite`` builds beside a finished output in ``.NAME.overwrite``: a link (to a
    folder of someone's files), a FIFO or a folder hydra-ens did not make at that name is refused
    in one line; nothing is written through it, nothing hangs, the output is unchanged."""
    out = w / f"built-{planted}"
    if not (out / "hydra").is_dir():
        assert main(build(w, "--num-pruned", "1", out=out.name)) == 0
    before = _digest(out)
    victim = w / f"victim-{planted}"
    victim.mkdir(exist_ok=True)
    (victim / "mine.txt").write_text("a file the user cares about\n")
    staging = w / f".{out.name}.overwrite"
    if planted == "symlink" and not staging.is_symlink():
        staging.symlink_to(victim, target_is_directory=True)
    elif planted == "fifo" and not staging.exists():
        os.mkfifo(staging)
    elif planted == "foreign-folder":
        staging.mkdir(exist_ok=True)
        (staging / "mine.txt").write_text("a file the user cares about\n")
    capsys.readouterr()
    assert run([*build(w, "--num-pruned", "1", out=out.name), "--overwrite"]) == 2
    lines = said(capsys.readouterr().err)
    assert len(lines) == 1 and "not a folder hydra-ens made" in lines[0], lines
    assert sorted(p.name for p in victim.iterdir()) == ["mine.txt"] and _digest(out) == before
    assert not out.is_symlink() and (staging.is_symlink() or staging.exists())


def test_what_a_run_with_other_options_left_never_survives_into_a_build(w, capsys):
    """A killed ``build --overwrite --fine-tune`` leaves ``members/`` in its staging folder; a rerun
    without ``--fine-tune`` starts afresh there (its output holds no stale members); without
    ``--overwrite`` a folder holding another run's leftovers is refused, not mixed."""
    out = w / "built-stale"
    if not (out / "hydra").is_dir():
        assert main(build(w, "--num-pruned", "1", out=out.name)) == 0
    staging = w / f".{out.name}.overwrite"
    (staging / "members" / "member-0").mkdir(parents=True)  # as a killed fine-tuned run leaves it
    (staging / ".hydra-ens-run").write_text("the settings of another run\n")
    assert main([*build(w, "--num-pruned", "1", out=out.name), "--overwrite"]) == 0
    assert not (out / "members").exists() and not staging.exists()
    partial = w / "built-partial"
    (partial / "members" / "member-0").mkdir(parents=True)
    (partial / ".hydra-ens-run").write_text("the settings of another run\n")
    capsys.readouterr()
    assert run(build(w, "--num-pruned", "1", out=partial.name)) == 2
    lines = said(capsys.readouterr().err)
    assert len(lines) == 1 and "a run with other options left" in lines[0], lines
    assert (partial / "members" / "member-0").is_dir() and not (partial / "hydra").exists()


def test_a_second_process_writing_the_same_output_is_refused(w, capsys):
    """The first writer holds the output's lock (here: this test, as another process would); the
    second is refused with one line and writes nothing."""
    from hydra_cli.guards import output_lock

    out = w / "contended.json"
    with output_lock(out):
        assert run(score(w, "--method", "taylor", *HEADS_PER_LAYER, out="contended.json")) == 2
    lines = said(capsys.readouterr().err)
    assert len(lines) == 1 and "another process is writing" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("command", ["demo", "analyze"])
def test_a_second_demo_or_analysis_into_one_folder_is_refused(w, capsys, command):
    from hydra_cli.guards import output_lock

    with output_lock(w / f"{command}-folder"):
        assert run([command, "--out", str(w / f"{command}-folder")]) == 2
    lines = said(capsys.readouterr().err)
    assert len(lines) == 1 and "another process is writing" in lines[0]


def test_a_killed_fuse_leaves_nothing_that_blocks_its_rerun(w, capsys):
    """A save killed midway leaves its temporary weights file; the rerun (no --overwrite) removes
    it and succeeds instead of calling the folder "not empty"."""
    import subprocess
    import sys

    (w / "heads-good.json").write_text('[{"0": [0, 1]}, {"1": [1, 2]}]')
    out = w / "fused-killed"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a process that is gone, as a killed writer is
    stale = out / f".model.safetensors.{child.pid}.k9w3.tmp"
    stale.write_bytes(b"\0" * 4096)
    assert run(fuse(w, "heads-good.json", out="fused-killed")) == 0
    assert not stale.exists() and (out / "hydra_config.json").is_file()


def test_a_full_disk_is_one_line_and_leaves_nothing(w, capsys, monkeypatch):
    """safetensors reports a full disk in its own error type: one line, exit 2, no model left."""
    from safetensors import SafetensorError

    from hydra_ensembles.saving import formats as serialization

    def full(*args, **kwargs):
        raise SafetensorError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
            'message: "No space left on device" })'
        )

    monkeypatch.setattr(serialization, "save_file", full)
    (w / "heads-good.json").write_text('[{"0": [0, 1]}, {"1": [1, 2]}]')
    assert run(fuse(w, "heads-good.json", out="fused-full")) == 2
    lines = said(capsys.readouterr().err)
    assert len(lines) == 1 and "No space left on device" in lines[0], lines
    assert not (w / "fused-full").exists() or not any((w / "fused-full").iterdir())


def test_eval_replaces_its_own_report_but_not_the_users_files(w, capsys):
    assert run(evaluate(w, out="report-twice")) == 0
    assert (w / "report-twice" / ".hydra-ens-report").is_file()
    assert run(evaluate(w, out="report-twice")) == 0  # its own folder: the report is replaced
    (w / "mine").mkdir()
    (w / "mine" / "report.md").write_text("my notes")
    assert run(evaluate(w, out="mine")) == 2
    assert (w / "mine" / "report.md").read_text() == "my notes"
    assert run([*evaluate(w, out="mine"), "--overwrite"]) == 0
    assert (w / "mine" / "report.md").read_text() != "my notes"


def test_python_api_errors_are_typed(w):
    from hydra_ensembles.fusion import HydraLoadError
    from hydra_ensembles.heads import HeadSetError
    from hydra_ensembles.members.storage import MemberLoadError
    from hydra_ensembles.models import ModelNotFoundError, load_classifier

    with pytest.raises(ModelNotFoundError):
        load_classifier(str(w / "nowhere"))
    with pytest.raises(MemberLoadError, match="modified"):
        load_member(w / "member-edited")
    with pytest.raises(HydraLoadError, match="checksum"):
        he.load_hydra(w / "hydra-tampered")
    order = he.CircuitOrder("acc", [4, 4], 1.0, [(0, 1), (1, 2)], [1.0, 1.0])
    with pytest.raises(HeadSetError, match="ranks 2"):
        he.sample_members(order, 2, num_pruned=2, pool_size=4)
    torch.manual_seed(1)  # the same architecture with other weights: another base model
    other = he.prune(BertForSequenceClassification(BertConfig(**TINY, num_labels=2)), he.HeadSet({0: [0]}))
    mine = he.prune(load_any(str(w / "model")), he.HeadSet({1: [0]}))  # same configuration
    with pytest.raises(ValueError, match="base model"):
        he.fuse([mine, other])


def test_eval_reads_each_method_through_its_own_tokenizer(w, capsys):
    """A method's results do not depend on which other methods share the eval call: each is fed
    by the tokenizer saved with it."""
    rows = (w / "train.csv").read_text().splitlines()
    titled = [f"{text.title()},{label}" for text, label in (r.rsplit(",", 1) for r in rows[1:])]
    (w / "capitals.csv").write_text("\n".join([rows[0], *titled]) + "\n")
    common = ["--id-data", str(w / "capitals.csv"), "--max-length", "12"]
    assert main(["eval", "--method", f"cased={w / 'model-cased'}", *common, "--out", str(w / "r1")]) == 0
    both = ["--method", f"m={w / 'model'}", "--method", f"cased={w / 'model-cased'}"]
    assert main(["eval", *both, *common, "--out", str(w / "r2")]) == 0
    alone = json.loads((w / "r1" / "results.json").read_text())["results"]["cased"]["classification"]
    mixed = json.loads((w / "r2" / "results.json").read_text())["results"]
    assert mixed["cased"]["classification"] == alone
    assert mixed["cased"]["classification"] != mixed["m"]["classification"]  # read otherwise


def test_a_byte_order_mark_is_read_as_utf8(w, capsys):
    """Excel saves UTF-8 CSVs with a byte-order mark: its first column is still ``text``."""
    (w / "bom.csv").write_bytes(b"\xef\xbb\xbf" + (w / "train.csv").read_bytes())
    assert main(predict(w, "--labelled", data="bom.csv", out="bom.jsonl")) == 0
    plain = main(predict(w, "--labelled", out="plain.jsonl"))
    assert plain == 0
    strip = [{k: v for k, v in json.loads(line).items() if k != "id"} for line in (w / "bom.jsonl").open()]
    assert strip == [
        {k: v for k, v in json.loads(line).items() if k != "id"} for line in (w / "plain.jsonl").open()
    ]


def test_a_local_path_named_like_a_built_in_dataset_is_refused_as_ambiguous(w, capsys, monkeypatch):
    monkeypatch.chdir(w)
    (w / "textures").mkdir(exist_ok=True)
    assert main(["score", str(w / "vit"), "--data", "textures", "--out", str(w / "t.json")]) == 2
    assert "write ./textures for the path" in capsys.readouterr().err and not (w / "t.json").exists()


def test_a_saved_classifier_loads_with_its_own_head_as_the_readme_loads_it(tmp_path):
    """``load_classifier("tuned/")`` (the README's snippet) keeps a saved head of any size; a
    number of classes that contradicts it is refused."""
    from hydra_ensembles.models import load_classifier

    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(**TINY, num_labels=4)).save_pretrained(tmp_path / "tuned")
    assert load_classifier(str(tmp_path / "tuned")).config.num_labels == 4
    with pytest.raises(ValueError, match="contradicts"):
        load_classifier(str(tmp_path / "tuned"), num_labels=2)


@pytest.mark.same_in_every_precision
def test_build_on_ray_never_saves_its_workers_model_through_a_planted_link(tmp_path):
    """build --engine ray saves each built model under checkpoints/ for Ray's workers: a link
    planted there (at the folder, or at checkpoints/ itself) is refused in one line, and nothing is
    written through it."""
    import argparse

    from hydra_cli.build import _ray_statistics
    from hydra_ensembles.saving.files import OutputError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for planted in ("checkpoints/statistics-model", "checkpoints"):
        out = tmp_path / f"out-{planted.count('/')}"
        (out / planted).parent.mkdir(parents=True, exist_ok=True)
        (out / planted).symlink_to(elsewhere, target_is_directory=True)
        fit = _ray_statistics(argparse.Namespace(), None, out / "checkpoints")
        with pytest.raises(OutputError, match="link"):
            fit(object())
        assert list(elsewhere.iterdir()) == []
