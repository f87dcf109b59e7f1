"""Models saved by an earlier version of the library load and predict what they predicted then:
every saved format (fused Hydra models with grouped linear layers, per-member LayerNorms, MPNet's
per-member head biases and DeBERTa's per-member position tables; a pruned member; BatchEnsemble,
Deep Ensemble (D), Packed-Ensemble and MIMO members; an ensemble of members), written by
``tests/fixtures/write_saved.py`` with that version, each beside the inputs it ran on and the logits
it gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hydra_ensembles.loading import load_any
from hydra_ensembles.members import as_ensemble

SAVED = Path(__file__).resolve().parent / "fixtures" / "saved"
TOL = 1e-5
"""The logits were written in float32 on one CPU; another CPU's kernels may round differently."""


@pytest.mark.parametrize("name", sorted(p.name for p in SAVED.iterdir() if p.is_dir()))
def test_a_model_saved_by_an_earlier_version_predicts_as_it_did(name):
    record = load_file(SAVED / f"{name}.safetensors")
    inputs = {k.removeprefix("input."): v for k, v in record.items() if k.startswith("input.")}
    model = load_any(str(SAVED / name))
    with torch.no_grad():
        logits = as_ensemble(model).eval()(**inputs).member_logits
    assert logits.shape == record["member_logits"].shape
    assert (logits - record["member_logits"]).abs().max().item() <= TOL


def test_every_format_is_there():
    assert {p.name for p in SAVED.iterdir() if p.is_dir()} == {
        "hydra-bert",
        "hydra-mpnet",
        "hydra-deberta",
        "member",
        "batch-ensemble",
        "head-ensemble",
        "packed-ensemble",
        "mimo",
        "deep-ensemble",
    }
