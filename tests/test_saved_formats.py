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

import hydra_ensembles as he
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


@pytest.mark.parametrize("name", sorted(p.name for p in SAVED.iterdir() if p.is_dir()))
def test_every_saved_format_is_served_saved_again_and_served_the_same(name, tmp_path):
    """The Auto class serves every format (a BatchEnsemble, Packed-Ensemble, MIMO and heads model
    included, which answer for their members at once) with the logits the format's loader gives,
    and `save_pretrained` writes it back in its own format, served the same again."""
    from hydra_ensembles.serving import HydraPreTrainedModel

    record = load_file(SAVED / f"{name}.safetensors")
    inputs = {k.removeprefix("input."): v for k, v in record.items() if k.startswith("input.")}
    served = HydraPreTrainedModel.from_pretrained(SAVED / name, precision="fp32")
    with torch.no_grad():
        first = served(**inputs).logits_per_member
        assert (first.transpose(0, 1) - record["member_logits"]).abs().max().item() <= TOL
        served.save_pretrained(tmp_path / "again")
        again = HydraPreTrainedModel.from_pretrained(tmp_path / "again", precision="fp32")
        assert again.config.saved_format == served.config.saved_format
        assert torch.equal(again(**inputs).logits_per_member, first)


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


def test_a_new_saved_format_is_one_registration(tmp_path):
    """A format registered with `register_saved_format` is found by its marker file and loaded by
    `load_any` and (as a classifier) `load_saved`; a second format claiming the marker is refused."""
    from hydra_ensembles.loading import load_saved
    from hydra_ensembles.saving.formats import SAVED_FORMATS, SavedFormat, register_saved_format, saved_format
    from tests.factories import text_inputs, tiny_bert

    model = tiny_bert(layers=1, heads=2).eval()
    toy = SavedFormat("toy", "toy_config.json", load=lambda folder: model)
    register_saved_format(toy)
    try:
        (tmp_path / "toy_config.json").write_text("{}")
        assert saved_format(tmp_path) is toy
        assert load_any(str(tmp_path)) is model and load_saved(tmp_path) == (model, "toy")
        with pytest.raises(ValueError, match=r"toy_config\.json marks toy folders already"):
            register_saved_format(SavedFormat("other", "toy_config.json", load=lambda folder: None))
    finally:
        SAVED_FORMATS.pop("toy")
    assert saved_format(tmp_path) is None
    x = text_inputs(batch=2)
    with torch.no_grad():
        assert load_any(str(SAVED / "member"))(**x).logits.shape == (2, 3)


def test_a_registered_format_saves_serves_and_loads(tmp_path):
    """One registration binds a model class to its saver and loader: `save_model`, the served
    Auto class (its ``saved_format`` and ``save_pretrained``), `HydraConfig` and `load_saved` all
    take it without a change elsewhere."""
    from torch import nn

    from hydra_ensembles.configuration import HydraConfig
    from hydra_ensembles.loading import load_saved
    from hydra_ensembles.saving.formats import (
        SAVED_FORMATS,
        SavedFormat,
        format_of,
        register_saved_format,
        save_model,
    )
    from hydra_ensembles.serving import HydraPreTrainedModel
    from tests.factories import text_inputs, tiny_bert

    class Toy(nn.Module):
        def __init__(self, member: nn.Module) -> None:
            super().__init__()
            self.member, self.config, self.num_members = member, member.config, 1

        def forward(self, **inputs):
            return he.EnsembleOutput.from_member_logits(self.member(**inputs).logits[None])

    def save(model: Toy, folder):
        he.save_member(model.member, folder / "inner")
        (folder / "toy_config.json").write_text("{}")
        return folder

    loaded = []

    def load(folder):
        loaded.append(folder)
        return Toy(he.load_member(folder / "inner"))

    toy = Toy(tiny_bert(layers=1, heads=2).eval())
    with pytest.raises(ValueError, match="saved_format must be one of"):
        HydraConfig(saved_format="toy")
    register_saved_format(SavedFormat("toy", "toy_config.json", load, model_class=Toy, save=save))
    try:
        assert format_of(toy).kind == "toy" and format_of(toy.member).kind == "member"
        assert HydraConfig(saved_format="toy").saved_format == "toy"
        save_model(toy, tmp_path / "a")
        assert isinstance(load_saved(tmp_path / "a")[0], Toy) and load_saved(tmp_path / "a")[1] == "toy"
        served = HydraPreTrainedModel.from_ensemble(toy)
        assert served.config.saved_format == "toy"
        served.save_pretrained(tmp_path / "b")
        again = HydraPreTrainedModel.from_pretrained(tmp_path / "b")
        x = text_inputs(batch=2)
        with torch.no_grad():
            assert torch.equal(again(**x).logits, served(**x).logits)
        assert loaded[-1] == tmp_path / "b"
    finally:
        SAVED_FORMATS.pop("toy")


def test_the_library_registers_its_saved_formats():
    from hydra_ensembles.saving.formats import SAVED_FORMATS

    assert {"fused", "member", "ensemble", "zero-shot"} <= set(SAVED_FORMATS)
    assert [k for k, f in SAVED_FORMATS.items() if not f.classifier] == ["zero-shot"]


def test_a_hugging_face_classifier_folder_is_written_by_its_format(tmp_path):
    """`members.storage.CLASSIFIER` writes what finetune and calibrate write for a plain classifier:
    a folder transformers reads as it is, with the calibration's statistics and checksums, that no
    registered format claims (the library knows it by elimination) and that loads back equal."""
    from transformers import AutoModelForSequenceClassification

    from hydra_ensembles.build import save_with_preprocessor
    from hydra_ensembles.members.storage import CLASSIFIER
    from hydra_ensembles.saving.formats import FOLDER_CHECKSUMS, saved_format
    from tests.factories import text_inputs, tiny_bert

    model = tiny_bert().eval()
    folder = save_with_preprocessor(model, tmp_path / "tuned", None, CLASSIFIER)
    assert (folder / FOLDER_CHECKSUMS).is_file() and saved_format(folder) is None
    x = text_inputs()
    with torch.no_grad():
        want = model(**x).logits
        for loaded in (load_any(str(folder)), AutoModelForSequenceClassification.from_pretrained(folder)):
            assert torch.equal(loaded.eval()(**x).logits, want)


CALIBRATED = Path(__file__).resolve().parent / "fixtures" / "saved-calibrated"


@pytest.mark.parametrize("name", sorted(p.name for p in CALIBRATED.iterdir() if p.is_dir()))
def test_a_calibration_saved_flat_by_an_earlier_version_serves_as_it_did(name, tmp_path):
    """A model calibrated and saved by a version that wrote the calibration as one flat record
    (``tests/fixtures/write_calibrated.py``): its calibration loads in parts, with its feature
    statistics where it has them, gives the records it gave then, and is saved again (the
    statistics with it) and read back the same."""
    import json

    from hydra_ensembles.calibration import saved_calibration
    from hydra_ensembles.evaluation import predict
    from hydra_ensembles.saving.metadata import read_metadata

    inputs = load_file(CALIBRATED / f"{name}.safetensors")
    inputs = {k.removeprefix("input."): v for k, v in inputs.items()}
    expected = json.loads((CALIBRATED / f"{name}.records.json").read_text())
    model = load_any(str(CALIBRATED / name))
    calibration = saved_calibration(model)
    assert calibration is not None and "score" in read_metadata(model).calibration  # the flat record
    preds = predict(model, [inputs], precision="fp32", progress=False, layers=calibration.flag.reads_layers)
    records = calibration.records(preds)
    assert [r["flagged"] for r in records] == [r["flagged"] for r in expected]
    for record, then in zip(records, expected, strict=True):
        assert record.keys() == then.keys()
        for key, value in then.items():
            assert record[key] == (
                pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value
            )
    if calibration.flag.statistics_sha256:  # the feature scores' statistics travel with it
        assert calibration.flag.statistics is not None and calibration.sets is not None
    (model.save_pretrained if isinstance(model, he.HydraModel) else lambda f: he.save_member(model, f))(
        tmp_path / "again"
    )
    assert saved_calibration(load_any(str(tmp_path / "again"))) == calibration
