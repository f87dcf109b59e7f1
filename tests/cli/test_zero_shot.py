"""``hydra-ens zero-shot`` on a tiny random CLIP saved to disk (tokenizer, image processor) and an
image file: circuit over both towers, fused model saved, then eval and predict load it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import CLIPImageProcessor, PreTrainedTokenizerFast

from hydra_cli import main
from hydra_ensembles.calibration import saved_calibration
from hydra_ensembles.ood import logit_scores
from hydra_ensembles.zero_shot import ZeroShotHydra, load_dual_encoder
from tests.factories import tiny_clip_model, tiny_siglip_model


def _save_word_tokenizer(folder, words: list[str], end_of_text: bool) -> None:
    """A word-level tokenizer (<unk> 0, <pad> 1, </s> 2, then ``words``) saved to ``folder``;
    with ``end_of_text``, every text ends in </s>, CLIP's way (its pooling reads that token)."""
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{w: i for i, w in enumerate(words, 3)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "<pad>", "unk_token": "<unk>"}
    if end_of_text:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", 2)]
        )
        special["eos_token"] = "</s>"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A 3-channel tiny CLIP with a word-level tokenizer (eos 2) and an 8 x 8 image processor,
    plus labelled ID images and unlabelled OOD images in .npz files."""
    root = tmp_path_factory.mktemp("clip")
    clip = tiny_clip_model()
    clip.config.vision_config.num_channels = 3
    torch.manual_seed(0)
    clip = type(clip)(clip.config).eval()
    clip.save_pretrained(root / "model")
    _save_word_tokenizer(root / "model", ["a", "photo", "of", "cat", "dog", "car"], end_of_text=True)
    CLIPImageProcessor(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}).save_pretrained(
        root / "model"
    )
    rng = np.random.default_rng(0)
    np.savez(root / "id.npz", x=rng.integers(0, 256, (12, 8, 8), dtype=np.uint8), y=np.arange(12) % 3)
    np.savez(root / "ood.npz", x=rng.integers(0, 256, (8, 8, 8), dtype=np.uint8), y=np.zeros(8, dtype=int))
    return root


def test_load_dual_encoder_reads_a_clip_checkpoint_with_its_tokenizer(clip_dir):
    model = load_dual_encoder(str(clip_dir / "model"), ["cat", "dog", "car"])
    assert model.config.templates == ["A photo of a {}."]
    assert model.config.input_pooling == "image_embeds"
    assert tuple(model.prompt_inputs["input_ids"][0, -1:].tolist()) == (2,)  # ends in end-of-text
    with pytest.raises(ValueError, match="own learned logit scale"):
        load_dual_encoder(str(clip_dir / "model"), ["cat", "dog"], logit_scale=10.0)


def test_zero_shot_command_builds_a_model_that_eval_and_predict_load(clip_dir, tmp_path, capsys):
    out = tmp_path / "zs"
    args = [
        "zero-shot", str(clip_dir / "model"), "--labels", "cat,dog,car", "--template", "a photo of {}",
        "--template", "{}", "--data", str(clip_dir / "id.npz"), "--ood-data", str(clip_dir / "ood.npz"),
        "--members", "2", "--num-pruned", "3", "--pool-size", "5", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    assert "saved the zero-shot Hydra" in capsys.readouterr().out
    model = ZeroShotHydra.from_pretrained(out / "zero-shot")
    assert model.num_members == 2 and model.config.classes == ["cat", "dog", "car"]
    assert len(json.loads((out / "circuit.json").read_text())["removed"]) == 5
    assert not (out / "circuit-checkpoint.json").exists()
    report = tmp_path / "eval"
    code = main(
        ["eval", "--method", f"Hydra={out / 'zero-shot'}", "--id-data", str(clip_dir / "id.npz"),
         "--ood", f"noise={clip_dir / 'ood.npz'}:far", "--out", str(report)]
    )  # fmt: skip
    assert code == 0
    results = json.loads((report / "results.json").read_text())["results"]
    assert 0 <= results["Hydra"]["classification"]["acc"] <= 1
    preds = tmp_path / "preds.csv"
    assert (
        main(["predict", str(out / "zero-shot"), "--data", str(clip_dir / "ood.npz"), "--out", str(preds)])
        == 0
    )
    assert len(preds.read_text().splitlines()) == 1 + 8
    calibration = saved_calibration(model)  # fit on --data, the ID validation the circuit used
    # the flag score chosen on the OOD validation data (no feature statistics: no training data)
    assert (
        calibration.provenance.validation.name == str(clip_dir / "id.npz")
        and calibration.flag.score in logit_scores()
    )
    assert "flagged" in preds.read_text().splitlines()[0]  # predict flags with it
    assert main(args) == 2  # a finished result is not overwritten silently


@pytest.fixture(scope="module", params=[1, 2], ids=["siglip", "siglip2"])
def siglip_dir(tmp_path_factory, request):
    """A 3-channel tiny SigLIP (or SigLIP 2) saved with a word-level tokenizer (prompts padded to
    the text tower's 8 positions, SigLIP's way) and an image processor (8 x 8; SigLIP 2's: up to
    4 patches of 4 x 4, so 8 x 12 images keep their aspect), plus ID and OOD images."""
    from transformers import Siglip2ImageProcessor, SiglipImageProcessor

    root = tmp_path_factory.mktemp(f"siglip{request.param}")
    siglip = tiny_siglip_model(version=request.param)
    siglip.config.vision_config.num_channels = 3
    torch.manual_seed(0)
    siglip = type(siglip)(siglip.config).eval()
    with torch.no_grad():
        siglip.logit_scale.fill_(2.3)
        siglip.logit_bias.fill_(-4.0)
    siglip.save_pretrained(root / "model")
    _save_word_tokenizer(root / "model", ["this", "is", "cat", "dog"], end_of_text=False)
    if request.param == 1:
        SiglipImageProcessor(size={"height": 8, "width": 8}).save_pretrained(root / "model")
    else:
        Siglip2ImageProcessor(patch_size=4, max_num_patches=4).save_pretrained(root / "model")
    rng = np.random.default_rng(1)
    width = 8 if request.param == 1 else 12
    labels = np.arange(12) // 2 % 2  # cat, cat, dog, dog, ...: both classes among every second input
    np.savez(root / "id.npz", x=rng.integers(0, 256, (12, 8, width), dtype=np.uint8), y=labels)
    np.savez(
        root / "ood.npz", x=rng.integers(0, 256, (6, 8, width), dtype=np.uint8), y=np.zeros(6, dtype=int)
    )
    return root


def test_zero_shot_command_on_a_siglip_checkpoint(siglip_dir, tmp_path, capsys):
    """``load_dual_encoder`` reads SigLIP (its own scale and bias, prompts padded to full length),
    and ``hydra-ens zero-shot`` builds a fused model that ``predict`` runs on images."""
    model = load_dual_encoder(str(siglip_dir / "model"), ["cat", "dog"], templates=["this is {}"])
    assert model.config.input_pooling == "image_pooler" and model.config.logit_bias != 0
    assert model.prompt_inputs["input_ids"].shape == (2, 8)  # padded to max_position_embeddings
    with pytest.raises(ValueError, match="own learned logit scale and bias"):
        load_dual_encoder(str(siglip_dir / "model"), ["cat", "dog"], logit_scale=10.0)
    out = tmp_path / "zs"
    args = [
        "zero-shot", str(siglip_dir / "model"), "--labels", "cat,dog", "--template", "this is {}",
        "--data", str(siglip_dir / "id.npz"), "--ood-data", str(siglip_dir / "ood.npz"),
        "--members", "2", "--num-pruned", "2", "--pool-size", "4", "--out", str(out),
    ]  # fmt: skip
    assert main(args) == 0
    fused = ZeroShotHydra.from_pretrained(out / "zero-shot")
    assert fused.num_members == 2 and fused.config.logit_bias == model.config.logit_bias
    preds = tmp_path / "preds.csv"
    assert (
        main(["predict", str(out / "zero-shot"), "--data", str(siglip_dir / "ood.npz"), "--out", str(preds)])
        == 0
    )
    assert len(preds.read_text().splitlines()) == 1 + 6
