"""DINOv2 family: ``Dinov2Model`` and ``Dinov2ForImageClassification`` (ViT layout plus layer scale)."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Part
from .vit import ViTAdapter


class Dinov2Adapter(ViTAdapter):
    """``encoder.layer[i].attention.{q,k,v,o}_proj`` as in ViT; each layer also scales its
    attention and MLP outputs per channel (``layer_scale1``/``layer_scale2``), which fusion treats
    like a LayerNorm's gain: kept per member unless ``norms="merge"``."""

    family = "DINOv2"
    model_types = ("dinov2",)

    def part_of(self, path: str, module: nn.Module) -> Part:
        part = super().part_of(path, module)
        if part == "mlp" and path.rpartition(".")[2].startswith("layer_scale"):
            return "norm"
        return part

    def mlp_width(self, model: nn.Module) -> int:
        config = self.encoder_config(model)
        return int(config.hidden_size * config.mlp_ratio)

    def set_mlp_width(self, model: nn.Module, width: int) -> None:
        """DINOv2's configuration gives the MLP width as ``hidden_size * mlp_ratio`` with an integer
        ratio: a width that is a multiple of the hidden size is recorded as its ratio, any other
        refused (as is the SwiGLU MLP, whose width is rounded from the ratio)."""
        config = self.encoder_config(model)
        hidden = config.hidden_size
        if getattr(config, "use_swiglu_ffn", False) or width % hidden:
            raise UnsupportedModelError(
                f"DINOv2 records its MLP width as a whole multiple of its hidden size ({hidden})"
                + (" and rounds a SwiGLU MLP's" if getattr(config, "use_swiglu_ffn", False) else "")
                + f": MLP pruning cannot record {width} neurons; keep a multiple of {hidden}"
            )
        config.mlp_ratio = width // hidden
