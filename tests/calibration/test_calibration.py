"""A model's calibration: fit like its parts, recorded in the configuration, saved and loaded with
every kind of saved model, refused where damaged."""

import copy
import functools
import json

import numpy as np
import pytest
import torch

import hydra_ensembles as he
from hydra_ensembles.calibration import Calibration, CalibrationConfig, Flag, calibrate, saved_calibration
from hydra_ensembles.calibration.calibration import RECORD_DIGEST
from hydra_ensembles.calibration.provenance import DataRecord, Provenance
from hydra_ensembles.evaluation import (
    Predictions,
    fit_temperature,
    flag_threshold,
    ood_scores,
    per_example,
    predict,
)
from hydra_ensembles.evaluation.conformal import conformal_threshold
from hydra_ensembles.hashing import batches_digest, fingerprint, json_digest
from hydra_ensembles.loading import load_any
from hydra_ensembles.members import DeepEnsemble
from hydra_ensembles.precision import resolve_precision
from hydra_ensembles.training import FineTuneConfig, fine_tune
from hydra_ensembles.zero_shot import ZeroShotHydra, fuse_dual_encoder
from tests.factories import image_inputs, labelled, text_inputs, tiny_bert, tiny_clip_zero_shot


def _val(batches: int = 3, batch: int = 24) -> list[dict]:
    return [labelled(text_inputs(batch, seed=b), seed=b) for b in range(batches)]


def test_fit_is_the_temperature_then_the_threshold_at_it():
    rng = np.random.default_rng(0)
    preds = Predictions(rng.normal(size=(3, 80, 4)) * 3, rng.integers(0, 4, 80))
    record = DataRecord("v.csv", "ab" * 32)
    calibration = Calibration.fit(
        preds, score="entropy", keep=0.9, set_method="", provenance=Provenance(record)
    )
    temperature = fit_temperature(preds)
    assert calibration.temperature == pytest.approx(temperature, rel=1e-12)
    scores = ood_scores(preds, "entropy", calibration.temperature)
    assert calibration.flag.method == "conformal" and calibration.flag.alpha == pytest.approx(0.1)
    assert calibration.flag.threshold == conformal_threshold(scores, 0.1)  # the 73rd smallest of 80
    assert calibration.flag.threshold == np.sort(scores)[72]
    assert (calibration.flag.score, calibration.flag.keep, calibration.examples) == ("entropy", 0.9, 80)
    records = calibration.records(preds)
    expected = per_example(preds, None, calibration.temperature, "entropy", calibration.flag.threshold)
    assert [{k: v for k, v in r.items() if k != "ood_p_value"} for r in records] == expected
    assert [r["ood_p_value"] <= 0.1 for r in records] == [r["flagged"] for r in records]
    assert np.mean([r["flagged"] for r in expected]) <= 0.1 + 1e-9
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration
    plain = Calibration.fit(preds, score="entropy", keep=0.9, flag_method="quantile")  # the plain quantile
    assert plain.flag.threshold == flag_threshold(preds, "entropy", 0.9, plain.temperature)
    assert "ood_p_value" not in plain.records(preds)[0]


def test_a_flag_fit_on_scores_computed_elsewhere_is_the_flag_fit_on_the_same_scores():
    """``id_scores`` (an exported graph's): the same calibration as scoring the predictions here,
    for both flag methods; scores that do not fit the inputs, or with ``auto``, are refused."""
    rng = np.random.default_rng(1)
    preds = Predictions(rng.normal(size=(2, 60, 3)) * 2, rng.integers(0, 3, 60))
    for method in ("conformal", "quantile"):
        own = Calibration.fit(preds, score="energy", keep=0.9, flag_method=method)
        scores = ood_scores(preds, "energy", own.temperature)
        assert Calibration.fit(preds, score="energy", keep=0.9, flag_method=method, id_scores=scores) == own
    shifted = Calibration.fit(preds, score="energy", keep=0.9, flag_method="quantile", id_scores=scores + 1.0)
    assert shifted.flag.threshold == pytest.approx(own.flag.threshold + 1.0)
    with pytest.raises(ValueError, match="one score per ID validation input, 60"):
        Calibration.fit(preds, score="energy", id_scores=scores[:10])
    with pytest.raises(ValueError, match="not 'auto'"):
        Calibration.fit(preds, score="auto", id_scores=scores)


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (("temperature",), 0.0, "temperature must be positive"),
        (("temperature",), float("nan"), "temperature must be positive"),
        (("flag", "score"), "msq", "unknown OOD score"),
        (("flag", "threshold"), float("inf"), "threshold must be finite"),
        (("flag", "keep"), 1.5, "keep must be in"),
        (("flag", "method"), "median", "unknown flag method"),
        (("examples",), 0, "at least one input"),
        (("extra",), 1, "has the fields"),
        (("flag", "extra"), 1, "flag has the fields"),
        (("sets",), {"method": "lac"}, "prediction sets has the fields"),
        (("provenance", "ood"), {"name": "o.csv"}, "ood record is a name and a SHA-256"),
        (("provenance", "validation", "sha256"), "abc", "64 lowercase hex"),
        (("temperature",), "warm", "malformed"),
    ],
)
def test_a_malformed_saved_calibration_is_refused(where, value, message):
    """Each field of each part checked on its own (a record whose checksum was recomputed after
    the change), and any change at all refused by the record's own checksum."""
    flag = Flag("msp", 0.3, 0.95)
    good = Calibration(
        1.2, flag, None, Provenance(DataRecord("v.csv", "0" * 64)), 50, "fp32", "1" * 64
    ).to_dict()
    changed = copy.deepcopy(good)
    *path, last = where
    functools.reduce(dict.__getitem__, path, changed)[last] = value
    del changed[RECORD_DIGEST]
    with pytest.raises(ValueError, match=message):
        Calibration.from_dict({**changed, RECORD_DIGEST: json_digest(changed)})
    with pytest.raises(ValueError, match="does not match its own checksum"):
        Calibration.from_dict({**changed, RECORD_DIGEST: good[RECORD_DIGEST]})


def test_calibrate_records_what_it_fit_on_in_the_configuration():
    model, val = tiny_bert(labels=3, init_range=0.3), _val()
    calibration = calibrate(model, val, score="msp", data="val.csv", progress=False)  # the run's precision
    assert saved_calibration(model) == calibration
    assert (
        calibration.provenance.validation.name == "val.csv"
        and calibration.provenance.validation.sha256 == batches_digest(val)
    )
    precision = resolve_precision("auto").name
    assert calibration.examples == 72 and calibration.precision == precision
    preds = predict(model, val, progress=False)
    digest = batches_digest(val)
    weights = fingerprint(model)
    fit = Calibration.fit(
        preds, provenance=Provenance(DataRecord("val.csv", digest)), precision=precision, model_sha256=weights
    )
    assert calibration == fit
    assert batches_digest(val) != batches_digest(_val(batches=2))
    with pytest.raises(ValueError, match="labelled ID validation"):
        calibrate(model, [text_inputs()])


def test_fit_calibration_measures_the_ood_validation_data_and_records_it_where_it_chose():
    """fit_calibration returns the predictions it fit on and, with OOD validation data, every
    candidate score's AUROC at the fitted temperature; the OOD data is recorded only where it
    chose the flag score, and statistics fit earlier keep the record of their data."""
    from hydra_ensembles.calibration import fit_calibration, fit_statistics
    from hydra_ensembles.evaluation.flag_score import validation_aurocs

    model, val = tiny_bert(labels=3, init_range=0.3), _val()
    ood = [text_inputs(24, seed=9)]
    fixed = fit_calibration(model, val, score="msp", ood_validation=ood, ood_data="o.csv", progress=False)
    expected = validation_aurocs(fixed.validation, fixed.ood_validation, None, fixed.calibration.temperature)
    assert fixed.aurocs == expected and set(expected) >= {"msp", "entropy"}
    assert fixed.calibration.provenance.ood == DataRecord()
    unmeasured = fit_calibration(
        model, val, score="msp", ood_validation=ood, measure_ood=False, progress=False
    )
    assert unmeasured.ood_validation is None and unmeasured.aurocs == {}  # not read: nothing chose on it
    assert unmeasured.calibration == fixed.calibration
    chosen = fit_calibration(model, val, score="auto", ood_validation=ood, ood_data="o.csv", progress=False)
    assert chosen.calibration.provenance.ood == DataRecord("o.csv", batches_digest(ood))
    statistics = fit_statistics(model, val, progress=False)
    record = DataRecord("train.csv", "c" * 64)
    kept = fit_calibration(
        model, val, score="mds", statistics=statistics, statistics_data=record, progress=False
    )
    assert kept.calibration.provenance.statistics == record and kept.aurocs == {}
    with pytest.raises(ValueError, match="not both"):
        fit_calibration(model, val, score="mds", statistics=statistics, id_train=val, progress=False)


@pytest.mark.parametrize("sha256", ["abc", "A" * 64, 7])
def test_a_data_record_holds_a_sha256_or_nothing(sha256):
    with pytest.raises(ValueError, match="SHA-256"):
        DataRecord("x.csv", sha256)


def test_every_saved_model_carries_its_calibration(tmp_path):
    """A Hugging Face classifier, a member, a Hydra model and a saved ensemble: calibrated, saved,
    loaded (by `load_any`, as the CLI does) with the same calibration; without one, None."""
    val = _val()
    base = tiny_bert(labels=3, init_range=0.3)
    heads = [he.HeadSet({0: [0, 1]}), he.HeadSet({1: [2, 3]})]
    members = [he.prune(base, hs) for hs in heads]
    models = {
        "hf": base,
        "member": members[0],
        "hydra": he.fuse(members, mlp="exact"),
        "ensemble": DeepEnsemble(members),
    }
    assert saved_calibration(models["hydra"]) is None
    for name, model in models.items():
        fitted = calibrate(model, val, score="energy", keep=0.8, data=name, progress=False)
        {
            "hf": lambda m, p: m.save_pretrained(p),
            "member": he.save_member,
            "hydra": he.HydraModel.save_pretrained,
            "ensemble": DeepEnsemble.save_pretrained,
        }[name](model, tmp_path / name)
        assert saved_calibration(load_any(str(tmp_path / name))) == fitted, name
    assert saved_calibration(models["member"]) is not None and saved_calibration(members[1]) is None


@pytest.mark.parametrize("score", ["msp", "mds"])
def test_a_zero_shot_hydra_carries_its_calibration(tmp_path, score):
    """Its calibration and (for a feature score) the statistics it was fit with, as every other
    saved model: loaded equal, and refused without them."""
    dual = tiny_clip_zero_shot()
    model = fuse_dual_encoder(dual, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})])
    batches = [labelled(image_inputs(20), labels=3)]
    train = [labelled(image_inputs(24, seed=1), labels=3)]
    fitted = calibrate(
        model, batches, score=score, id_train=train if score == "mds" else None, progress=False
    )
    model.save_pretrained(tmp_path / "zs")
    loaded = saved_calibration(ZeroShotHydra.from_pretrained(tmp_path / "zs"))
    assert loaded == fitted
    if score == "mds":
        assert (
            loaded.flag.statistics.digest()
            == fitted.flag.statistics.digest()
            == fitted.flag.statistics_sha256
        )
        (tmp_path / "zs" / "ood_statistics.safetensors").unlink()
        with pytest.raises(ValueError, match=r"ood_statistics\.safetensors"):
            ZeroShotHydra.from_pretrained(tmp_path / "zs")


def test_the_statistics_are_metadata_held_by_the_model():
    """``ModelMetadata.statistics``: read and written like every field, held by the model (a
    configuration cannot hold tensors), and forgotten with the calibration."""
    from hydra_ensembles.saving.metadata import read_metadata, write_metadata
    from hydra_ensembles.surgery import forget_calibration

    model, val = tiny_bert(labels=3, init_range=0.3), _val()
    fitted = calibrate(model, val, score="mds", id_train=val, progress=False)
    metadata = read_metadata(model)
    assert metadata.statistics is fitted.flag.statistics and metadata.calibration is not None
    assert read_metadata(model.config).statistics is None
    assert set(metadata.to_config()) == {"hydra_calibration"}  # the configuration's JSON: no tensors
    with pytest.raises(TypeError, match="configuration"):
        write_metadata(model.config, statistics=fitted.flag.statistics)
    forget_calibration(model)
    assert read_metadata(model).statistics is None and read_metadata(model).calibration is None


def test_an_edited_calibration_is_refused_by_the_checksum(tmp_path):
    members = [he.prune(tiny_bert(init_range=0.3), he.HeadSet({0: [m]})) for m in range(2)]
    hydra = he.fuse(members)
    calibrate(hydra, _val(), progress=False)
    hydra.save_pretrained(tmp_path / "h")
    config_file = tmp_path / "h" / "hydra_config.json"
    saved = json.loads(config_file.read_text())
    saved["base_config"]["hydra_calibration"]["threshold"] = 0.99  # flags nothing any more
    config_file.write_text(json.dumps(saved))
    with pytest.raises(he.HydraLoadError, match="checksum"):
        he.load_hydra(tmp_path / "h")


def test_a_calibration_holds_for_its_weights_only():
    """Models made from a calibrated one (pruned, fused, fine-tuned) start without its calibration;
    one whose weights changed in place refuses it."""
    model, val = tiny_bert(labels=3, init_range=0.3), _val()
    calibrate(model, val, progress=False)
    pruned = he.prune(model, he.HeadSet({0: [0, 1]}))
    assert saved_calibration(pruned) is None
    assert saved_calibration(he.fuse(model, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})])) is None
    assert saved_calibration(he.fuse([pruned, he.prune(model, he.HeadSet({1: [2]}))])) is None
    tuned = copy.deepcopy(model)
    fine_tune(tuned, val, config=FineTuneConfig(epochs=1), progress=False)
    assert saved_calibration(tuned) is None and saved_calibration(model) is not None
    with torch.no_grad():
        model.classifier.bias.add_(0.5)  # shifts every logit: the old temperature no longer holds
    with pytest.raises(ValueError, match="fit on other weights"):
        saved_calibration(model)


def test_one_settings_record_from_the_options_to_the_fit():
    """`CalibrationConfig` is what `Calibration.fit`, `fit_calibration`, `calibrate` and
    `BuildConfig` take; keywords replace single fields; a fitted calibration gives it back."""
    rng = np.random.default_rng(3)
    preds = Predictions(rng.normal(size=(2, 120, 4)) * 3, rng.integers(0, 4, 120))
    config = CalibrationConfig(score="entropy", keep=0.9, set_method="aps", set_alpha=0.2)
    fitted = Calibration.fit(preds, config)
    assert fitted == Calibration.fit(preds, score="entropy", keep=0.9, set_method="aps", set_alpha=0.2)
    assert fitted.config == config and fitted.sets.quantiles
    assert Calibration.fit(preds, config, keep=0.8).config == config.replace(keep=0.8)
    assert Calibration.from_dict(fitted.to_dict()).config == config  # saved and read back
    assert he.BuildConfig().calibration == CalibrationConfig(score="auto", set_method="lac")
    for bad, match in (
        ({"keep": 1.5}, "keep"),
        ({"flag_method": "maybe"}, "flag"),
        ({"set_method": "lacs"}, "prediction-set method"),
        ({"set_alpha": 0.0}, "set_alpha"),
        ({"score": ""}, "flag score"),
        ({"set_classwise": 1}, "set_classwise"),
    ):
        with pytest.raises(he.InputError, match=match):
            CalibrationConfig(**bad)
    with pytest.raises(TypeError, match="unknown calibration settings"):
        Calibration.fit(preds, config, sets="lac")
    with pytest.raises(TypeError, match="must be a CalibrationConfig"):
        Calibration.fit(preds, "entropy")
