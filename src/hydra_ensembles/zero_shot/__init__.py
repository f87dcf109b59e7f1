"""Zero-shot Hydra for dual encoders (CLIP, SigLIP, sentence encoders): classifier, fusion, saving."""

from .fused import ZeroShotHydra, ZeroShotLoadError, fuse_dual_encoder, split_head_set
from .model import (
    SENTENCE_LOGIT_SCALE,
    DualEncoderClassifier,
    DualEncoderConfig,
    from_clip,
    from_sentence_encoder,
    from_siglip,
    load_dual_encoder,
    tokenize_prompts,
)
from .towers import EncoderTower, pool

__all__ = [
    "SENTENCE_LOGIT_SCALE",
    "DualEncoderClassifier",
    "DualEncoderConfig",
    "EncoderTower",
    "ZeroShotHydra",
    "ZeroShotLoadError",
    "from_clip",
    "from_sentence_encoder",
    "from_siglip",
    "fuse_dual_encoder",
    "load_dual_encoder",
    "pool",
    "split_head_set",
    "tokenize_prompts",
]
