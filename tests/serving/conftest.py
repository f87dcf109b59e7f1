"""Saved classifiers to serve: a fused Hydra model, a member and an ensemble of members, with the
MiniLM tokenizer saved beside each (a small random BERT over MiniLM's vocabulary), and a ViT."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

import hydra_ensembles as he
from hydra_ensembles.calibration import calibrate
from hydra_ensembles.members import DeepEnsemble
from hydra_ensembles.models import load_tokenizer
from hydra_ensembles.serving.onnx import export_onnx

CLASSES = {0: "money", 1: "sport", 2: "weather"}
HEAD_SETS = (he.HeadSet({0: [0, 1], 1: [2]}), he.HeadSet({0: [3], 1: [0, 1]}), he.HeadSet({1: [3]}))
TEXTS = ["goal match team score", "bank shares market", "rain and wind tomorrow", "a recipe with flour"]


def tiny_text_classifier() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        initializer_range=0.2,
        id2label=CLASSES,
        label2id={v: k for k, v in CLASSES.items()},
    )
    return BertForSequenceClassification(config).eval()


def tiny_image_classifier() -> ViTForImageClassification:
    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=12,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=25,
        image_size=8,
        patch_size=4,
        num_channels=3,
        initializer_range=0.2,
        id2label=CLASSES,
        label2id={v: k for k, v in CLASSES.items()},
    )
    return ViTForImageClassification(config).eval()


def validation(tokenizer) -> list[dict[str, torch.Tensor]]:
    texts = [f"{word} {i}" for i in range(20) for word in ("goal", "bank", "rain")]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    return [{**batch, "labels": torch.arange(len(texts)) % 3}]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """Folders of a calibrated fused model, an uncalibrated one, a member and an ensemble."""
    root = tmp_path_factory.mktemp("serving")
    tokenizer = load_tokenizer()
    base = tiny_text_classifier()
    members = [he.prune(base, hs) for hs in HEAD_SETS]
    folders = {}
    for name in ("calibrated", "fused", "member", "ensemble"):
        folders[name] = root / name
        tokenizer.save_pretrained(folders[name])
    calibrated = he.fuse(members)
    calibrate(
        calibrated, validation(tokenizer), score="msp", keep=0.75, data="val", precision="fp32",
        progress=False, set_method="lac", set_alpha=0.2,
    )  # fmt: skip
    calibrated.save_pretrained(folders["calibrated"])
    he.fuse(members).save_pretrained(folders["fused"])
    he.save_member(members[1], folders["member"])
    ensemble = DeepEnsemble(members)
    calibrate(ensemble, validation(tokenizer), score="entropy", data="val", precision="fp32", progress=False)
    ensemble.save_pretrained(folders["ensemble"])
    return folders


@pytest.fixture(scope="session")
def cli_export(saved, tmp_path_factory):
    """The calibrated model exported by ``hydra-ens export`` (run once: each export costs seconds
    in torch's exporter), and what the command printed. Tests that read an export read this one or
    `exported`'s; their modules run on one pytest-xdist worker (the ``onnx`` group)."""
    from hydra_cli import main

    folder = tmp_path_factory.mktemp("cli-export") / "onnx"
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["export", str(saved["calibrated"]), "--out", str(folder)]) == 0
    return folder, said.getvalue()


@pytest.fixture(scope="session")
def exported(saved, cli_export, tmp_path_factory):
    """The ONNX exports of the calibrated model (`cli_export`'s) and of the ensemble of members."""
    root = tmp_path_factory.mktemp("onnx")
    return {"calibrated": cli_export[0], "ensemble": export_onnx(saved["ensemble"], root / "ensemble")}
