"""Factories for tests: tiny random models of every supported family, and their inputs."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable

import numpy as np
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    CLIPConfig,
    CLIPForImageClassification,
    DeiTConfig,
    DeiTForImageClassification,
    Dinov2Config,
    Dinov2ForImageClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ElectraConfig,
    ElectraForSequenceClassification,
    MPNetConfig,
    MPNetForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

VOCAB = 40


def _encoder(layers: int, heads: int, head_dim: int, labels: int, init_range: float) -> dict:
    """Config fields named alike by BERT, RoBERTa, ViT and DeiT."""
    hidden = heads * head_dim
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 2 * hidden + 1,
        "num_labels": labels,
        "initializer_range": init_range,
    }


def _image(**fields) -> dict:
    return {**fields, "image_size": 8, "patch_size": 4, "num_channels": 1}


def tiny_bert(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    intermediate=None,
    init_range: float = 0.02,
    dropout: float = 0.1,
) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    fields["intermediate_size"] = intermediate or fields["intermediate_size"]
    config = BertConfig(
        vocab_size=VOCAB,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **fields,
    )
    return BertForSequenceClassification(config).eval()


def tiny_roberta(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> RobertaForSequenceClassification:
    """RoBERTa: BERT's layout with its own embeddings (padding-aware positions) and head."""
    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    config = RobertaConfig(vocab_size=VOCAB, max_position_embeddings=40, **fields)
    return RobertaForSequenceClassification(config).eval()


def tiny_electra(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> ElectraForSequenceClassification:
    """ELECTRA: BERT's layout, with embeddings narrower than the layers and a projection between."""
    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    config = ElectraConfig(vocab_size=VOCAB, embedding_size=5, max_position_embeddings=32, **fields)
    return ElectraForSequenceClassification(config).eval()


def tiny_distilbert(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> DistilBertForSequenceClassification:
    """DistilBERT: W_O inside the attention module, its own layer list, config names and head."""
    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=fields.pop("hidden_size"),
        n_layers=fields.pop("num_hidden_layers"),
        n_heads=fields.pop("num_attention_heads"),
        hidden_dim=fields.pop("intermediate_size"),
        max_position_embeddings=32,
        **fields,
    )
    return DistilBertForSequenceClassification(config).eval()


def tiny_mpnet(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> MPNetForSequenceClassification:
    """MPNet: W_O inside ``attention.attn`` and a relative position bias per head, shared by all
    layers; the bias table is drawn wide (uniform in [-2, 2]) so a test notices any layer adding
    another head's channel."""
    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    model = MPNetForSequenceClassification(
        MPNetConfig(vocab_size=VOCAB, max_position_embeddings=40, **fields)
    )
    with torch.no_grad():
        model.mpnet.encoder.relative_attention_bias.weight.uniform_(-2.0, 2.0)
    return model.eval()


def tiny_vit(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> ViTForImageClassification:
    torch.manual_seed(seed)
    config = ViTConfig(**_image(**_encoder(layers, heads, head_dim, labels, init_range)))
    return ViTForImageClassification(config).eval()


def tiny_deit(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> DeiTForImageClassification:
    torch.manual_seed(seed)
    config = DeiTConfig(**_image(**_encoder(layers, heads, head_dim, labels, init_range)))
    return DeiTForImageClassification(config).eval()


def tiny_dinov2(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> Dinov2ForImageClassification:
    """DINOv2: ViT's layout with per-channel layer scales (set away from 1 and distinct per layer,
    so a test notices one applied twice or dropped) and a head on [CLS] and the mean patch."""
    torch.manual_seed(seed)
    fields = _image(**_encoder(layers, heads, head_dim, labels, init_range))
    fields.pop("intermediate_size")
    model = Dinov2ForImageClassification(Dinov2Config(**fields, mlp_ratio=2, layerscale_value=0.5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lambda1"):
                param.uniform_(0.2, 1.5)
    return model.eval()


def tiny_clip(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
) -> CLIPForImageClassification:
    """CLIP's vision tower with a classifier: pre-LayerNorm before the layers, mean-pooled patches."""
    torch.manual_seed(seed)
    fields = _image(**_encoder(layers, heads, head_dim, labels, init_range))
    labels_, init = fields.pop("num_labels"), fields.pop("initializer_range")
    text = {"vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    text |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 1}  # within the tiny vocabulary
    config = CLIPConfig(
        vision_config=fields, text_config={**text, "num_attention_heads": 2}, num_labels=labels_
    )
    config.vision_config.initializer_range = init
    config.initializer_factor = init / 0.02
    return CLIPForImageClassification(config).eval()


def tiny_siglip(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
):
    """SigLIP's vision tower with a classifier (mean-pooled patches, no class token) and, as in the
    released checkpoints, its attention-pooling head (which the classifier does not read)."""
    from transformers import SiglipConfig, SiglipForImageClassification

    torch.manual_seed(seed)
    fields = _image(**_encoder(layers, heads, head_dim, labels, init_range))
    labels_ = fields.pop("num_labels")
    fields.pop("initializer_range")
    text = {"vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    text |= {"num_attention_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 1}
    config = SiglipConfig(
        vision_config={**fields, "vision_use_head": True}, text_config=text, num_labels=labels_
    )
    return SiglipForImageClassification(config).eval()


def tiny_deberta(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    init_range: float = 0.02,
    v3: bool = True,
):
    """DeBERTa with disentangled attention: v3's settings (W_K and W_Q shared with the position
    terms, log-bucketed positions (4 buckets, so inputs of 9 tokens meet them), a layer-normed
    relative table, no absolute positions) or, with ``v3=False``, v2's own position projections
    (``pos_key_proj``, ``pos_query_proj``) and plain relative positions up to 6; the relative
    table drawn wide, so a test notices a head reading another's position terms."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    v3_position = {"share_att_key": True, "position_buckets": 4, "norm_rel_ebd": "layer_norm"}
    v2_position = {"share_att_key": False, "position_buckets": -1, "max_relative_positions": 6}
    position = {**v3_position, "max_relative_positions": 16} if v3 else v2_position
    config = DebertaV2Config(
        vocab_size=VOCAB,
        max_position_embeddings=32,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_biased_input=not v3,
        pooler_hidden_size=heads * head_dim,
        **position,
        **fields,
    )
    model = DebertaV2ForSequenceClassification(config)
    with torch.no_grad():
        model.deberta.encoder.rel_embeddings.weight.uniform_(-2.0, 2.0)
    return model.eval()


def tiny_modernbert(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    init_range: float = 0.02,
    pooling: str = "mean",
):
    """ModernBERT: packed Q/K/V, rotary embeddings (``head_dim`` rounded up to an even size, the
    hidden size ``heads`` times it), global layers alternating with local ones whose window (4
    tokens) is shorter than the test inputs, and the classifier's masked mean (or [CLS])."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    torch.manual_seed(seed)
    head_dim += head_dim % 2
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    config = ModernBertConfig(
        vocab_size=VOCAB,
        max_position_embeddings=32,
        global_attn_every_n_layers=2,
        local_attention=4,
        classifier_pooling=pooling,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        **fields,
    )
    return ModernBertForSequenceClassification(config).eval()


DECODERS = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": 4}),
    "qwen2": ("Qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3": ("Qwen3", {"attention_bias": True}),
    "gemma": ("Gemma", {}),
    "gemma2": ("Gemma2", {"sliding_window": 4, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 8}),
    "gemma3": ("Gemma3Text", {"sliding_window": 4, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2}),
}
"""Decoder LLM classifiers: (transformers class prefix, config fields that make the family what it
is: sliding windows shorter than the test inputs, Gemma 2's soft-capped scores and scaling,
Qwen3's q/k norms (always there) with biases on Q/K/V)."""
PAD = 0
"""The padding id of the tiny decoders (`decoder_inputs` pads with it; no real token is 0)."""


def tiny_decoder(
    family: str = "llama",
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    init_range: float = 0.02,
    kv_heads: int = 2,
):
    """A ``...ForSequenceClassification`` decoder LLM with grouped-query attention (``kv_heads``
    key/value heads for ``heads`` query heads); rotary embeddings need an even head size, so
    ``head_dim`` is rounded up to one, and the hidden size stays ``heads * head_dim``."""
    import transformers

    prefix, fields = DECODERS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        head_dim=head_dim + head_dim % 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=2 * heads * head_dim + 1,
        num_labels=labels,
        initializer_range=init_range,
        max_position_embeddings=64,
        pad_token_id=PAD,
        **fields,
    )
    return getattr(transformers, f"{prefix}ForSequenceClassification")(config).eval()


def tiny_siglip2(
    layers: int = 2, heads: int = 4, head_dim: int = 3, labels: int = 3, seed: int = 0, init_range=0.02
):
    """SigLIP 2's vision tower with a classifier: images as up to 4 patches of 4 x 4 grey pixels
    (a 2 x 2 position grid resized to each image's shape), padded patches masked."""
    from transformers import Siglip2Config, Siglip2ForImageClassification

    torch.manual_seed(seed)
    fields = _encoder(layers, heads, head_dim, labels, init_range)
    labels_ = fields.pop("num_labels")
    fields.pop("initializer_range")
    vision = {**fields, "patch_size": 4, "num_channels": 1, "num_patches": 4, "vision_use_head": True}
    text = {"vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    text |= {"num_attention_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 1}
    config = Siglip2Config(vision_config=vision, text_config=text, num_labels=labels_)
    model = Siglip2ForImageClassification(config)
    with torch.no_grad():  # position embeddings away from 0, so resizing them is seen
        model.vision_model.embeddings.position_embedding.weight.normal_(0, 0.5)
    return model.eval()


def patch_inputs(batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """SigLIP 2's inputs: 4 patch slots per image, images of 2 x 2, 1 x 3 and 2 x 1 patches in
    turn (the slots they leave empty masked out)."""
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([[2, 2], [1, 3], [2, 1]] * batch)[:batch]
    mask = (torch.arange(4)[None] < shapes.prod(1, keepdim=True)).long()
    pixels = torch.randn(batch, 4, 16, generator=g) * mask[..., None]
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def text_inputs(
    batch: int = 4, tokens: int = 9, seed: int = 0, padded: bool = True
) -> dict[str, torch.Tensor]:
    """Random token ids; with ``padded`` every other row has a different amount of padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if padded:
        for row in range(1, batch, 2):
            mask[row, max(1, tokens - row - 1) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def decoder_inputs(
    batch: int = 4, tokens: int = 9, seed: int = 0, padded: bool = True, left: bool = False
) -> dict[str, torch.Tensor]:
    """`text_inputs` padded with the decoders' ``PAD`` id, on the right (or the ``left``)."""
    inputs = text_inputs(batch, tokens, seed, padded)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    if left:
        mask = mask.flip(1)
        ids = torch.where(mask.bool(), ids.flip(1), ids)
    return {"input_ids": ids.masked_fill(mask == 0, PAD), "attention_mask": mask}


def image_inputs(batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 1, 8, 8, generator=g)}


def labelled(inputs: dict[str, torch.Tensor], labels: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """``inputs`` with random ``labels`` added."""
    batch = next(iter(inputs.values())).shape[0]
    return {
        **inputs,
        "labels": torch.randint(0, labels, (batch,), generator=torch.Generator().manual_seed(seed)),
    }


FAMILIES: dict[str, tuple[Callable[..., torch.nn.Module], Callable[..., dict[str, torch.Tensor]]]] = {
    "bert": (tiny_bert, text_inputs),
    "roberta": (tiny_roberta, text_inputs),
    "electra": (tiny_electra, text_inputs),
    "distilbert": (tiny_distilbert, text_inputs),
    "mpnet": (tiny_mpnet, text_inputs),
    "deberta-v3": (tiny_deberta, text_inputs),
    "modernbert": (tiny_modernbert, text_inputs),
    "deberta-v2": (functools.partial(tiny_deberta, v3=False), text_inputs),
    "vit": (tiny_vit, image_inputs),
    "deit": (tiny_deit, image_inputs),
    "dinov2": (tiny_dinov2, image_inputs),
    "clip": (tiny_clip, image_inputs),
    "siglip": (tiny_siglip, image_inputs),
    "siglip2": (tiny_siglip2, patch_inputs),
    **{name: (functools.partial(tiny_decoder, name), decoder_inputs) for name in DECODERS},
}
"""Every supported family: (tiny model factory, input factory); tests parametrize over it."""


def tiny_clip_model(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    text_layers: int = 2,
    text_heads: int = 2,
    seed: int = 0,
):
    """A full random ``CLIPModel`` (both towers, projections, logit scale) from a config."""
    from transformers import CLIPModel

    torch.manual_seed(seed)
    vision = _image(**_encoder(layers, heads, head_dim, 2, 0.02))
    vision.pop("num_labels")
    text = {
        "vocab_size": VOCAB,
        "hidden_size": text_heads * 4,
        "intermediate_size": 2 * text_heads * 4 + 1,
        "num_hidden_layers": text_layers,
        "num_attention_heads": text_heads,
        "max_position_embeddings": 16,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    config = CLIPConfig(vision_config=vision, text_config=text, projection_dim=6)
    return CLIPModel(config).eval()


def tiny_siglip_model(
    layers: int = 2, heads: int = 4, head_dim: int = 3, text_heads: int = 2, seed: int = 0, version: int = 1
):
    """A full random ``SiglipModel`` (both towers, the vision tower's attention-pooling head, the
    text projection, logit scale and bias); ``version=2``: a ``Siglip2Model`` of the same shapes,
    its images as patches (`patch_inputs`)."""
    import transformers

    prefix = "Siglip" if version == 1 else "Siglip2"
    torch.manual_seed(seed)
    vision = _encoder(layers, heads, head_dim, 2, 0.02)
    vision.pop("num_labels")
    vision.pop("initializer_range")
    vision = (
        _image(**vision) if version == 1 else {**vision, "patch_size": 4, "num_channels": 1, "num_patches": 4}
    )
    text = {
        "vocab_size": VOCAB,
        "hidden_size": text_heads * 4,
        "intermediate_size": 2 * text_heads * 4 + 1,
        "num_hidden_layers": layers,
        "num_attention_heads": text_heads,
        "max_position_embeddings": 8,
        "projection_size": heads * head_dim,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    config = getattr(transformers, f"{prefix}Config")(vision_config=vision, text_config=text)
    model = getattr(transformers, f"{prefix}Model")(config).eval()
    with torch.no_grad():  # a learned scale and bias, not the initial 0 and 0
        model.logit_scale.fill_(2.3)
        model.logit_bias.fill_(-4.0)
        if version == 2:  # position embeddings away from 0, so resizing them is seen
            model.vision_model.embeddings.position_embedding.weight.normal_(0, 0.5)
    return model


def tiny_siglip_zero_shot(
    classes: int = 3, templates: int = 2, heads_pool: str = "both", seed: int = 0, version: int = 1, **sizes
):
    """A zero-shot classifier over a tiny random SigLIP (``version=2``: SigLIP 2); its prompts fill
    the text tower's whole length (SigLIP pools the last position)."""
    from hydra_ensembles.zero_shot import from_siglip

    siglip = tiny_siglip_model(seed=seed, version=version, **sizes)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (classes * templates, 8), generator=g)
    names = [f"class{c}" for c in range(classes)]
    forms = [f"{{}} {t}" for t in range(templates)]
    return from_siglip(siglip, names, forms, prompt_inputs={"input_ids": ids}, heads=heads_pool)


def clip_prompts(classes: int, templates: int, tokens: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tokenised prompts for a tiny CLIP: random ids ending in the end-of-text id (2), ragged."""
    g = torch.Generator().manual_seed(seed)
    rows = classes * templates
    ids = torch.randint(3, VOCAB, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    for r in range(rows):
        end = tokens - 1 - (r % 3)
        ids[r, end] = 2
        ids[r, end + 1 :] = 1
        mask[r, end + 1 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def tiny_clip_zero_shot(
    classes: int = 3, templates: int = 2, heads_pool: str = "both", seed: int = 0, **sizes
):
    """A zero-shot classifier over a tiny random CLIP."""
    from hydra_ensembles.zero_shot import from_clip

    names = [f"class {i}" for i in range(classes)]
    prompts = clip_prompts(classes, templates, seed=seed)
    return from_clip(
        tiny_clip_model(seed=seed, **sizes), names, [f"t{i} {{}}" for i in range(templates)],
        prompt_inputs=prompts, heads=heads_pool,
    )  # fmt: skip


def tiny_sentence_zero_shot(
    classes: int = 3,
    templates: int = 2,
    heads_pool: str = "both",
    seed: int = 0,
    encoder: str = "bert",
    **sizes,
):
    """A zero-shot classifier over a tiny random BERT (or MPNet, ``encoder="mpnet"``) used as a
    sentence encoder (two copies)."""
    from hydra_ensembles.zero_shot import DualEncoderClassifier, DualEncoderConfig, EncoderTower

    if encoder == "mpnet":
        sizes.pop("dropout", None)
        base = tiny_mpnet(seed=seed, **sizes).mpnet
    else:
        base = tiny_bert(seed=seed, **{"dropout": 0.0, **sizes}).bert
    config = DualEncoderConfig(
        [f"class {i}" for i in range(classes)], [f"t{i} {{}}" for i in range(templates)], heads=heads_pool
    )
    prompts = text_inputs(classes * templates, tokens=5, seed=seed + 1)
    import copy

    towers = EncoderTower(base, "mean"), EncoderTower(copy.deepcopy(base), "mean")
    return DualEncoderClassifier(*towers, prompts, config).eval()


# ----------------------------------------------------------------------------- precisions
PRECISIONS = ("fp32", "bf16", "fp16")
"""Every precision users compute in; precision-dependent tests parametrize over it."""
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
"""Half a unit in the last place: the largest relative error of one rounding to the format."""
ROUNDINGS_PER_LAYER = 10
"""Rounding points a value passes in one transformer layer: Q/K/V, scores, softmax, attention
output, W_O, residual + LayerNorm, MLP in, activation, MLP out, residual + LayerNorm."""


def rounding_tolerance(
    precision: str, reference: torch.Tensor, layers: int, fp32: float | None = None
) -> float:
    """How far two computations of one tiny transformer in ``precision`` may be apart.

    In fp32: ``fp32`` where given, the test's own float tolerance. Otherwise, to first order: two
    computations that round at different points (a fused model and its members run one by one,
    a low-precision forward and an fp32 one) differ by at most 2u per rounding point, relative to
    the largest magnitude the output reaches, over ``ROUNDINGS_PER_LAYER`` points per layer and
    two for the task head.
    """
    if precision == "fp32" and fp32 is not None:
        return fp32
    roundings = ROUNDINGS_PER_LAYER * layers + 2
    return 2 * UNIT_ROUNDOFF[precision] * roundings * max(1.0, reference.abs().max().item())


def computing_in(precision: str):
    """Autocast to ``precision`` on the CPU (a no-op for fp32): explicit computations in tests run
    in the precision the code under test computes in."""
    from hydra_ensembles.precision import Precision

    return Precision(precision, "test").autocast("cpu")


def png_bytes(pixels: np.ndarray) -> bytes:
    """``pixels`` (rows, columns[, channels]) as the bytes of a PNG file."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def tiny_vit_and_photos(root, images_per_class: int, named: bool) -> str:
    """A tiny 16 x 16 RGB ViT with its image processor saved at ``root/vit`` (its classes named
    cat and dog where ``named``), and an image folder ``root/photos`` of 12 x 12 PNG files, dark
    cats and light dogs; returns the folder."""
    from transformers import ViTConfig, ViTForImageClassification

    try:
        from transformers import ViTImageProcessorPil as ViTProcessor
    except ImportError:  # pragma: no cover - older 5.x releases
        from transformers import ViTImageProcessor as ViTProcessor

    torch.manual_seed(0)
    names = {"id2label": {0: "cat", 1: "dog"}, "label2id": {"cat": 0, "dog": 1}} if named else {}
    config = ViTConfig(
        hidden_size=12, num_hidden_layers=2, num_attention_heads=4, intermediate_size=25, image_size=16,
        patch_size=8, num_channels=3, num_labels=2, initializer_range=0.3, **names,
    )  # fmt: skip
    ViTForImageClassification(config).save_pretrained(root / "vit")
    ViTProcessor(size={"height": 16, "width": 16}).save_pretrained(root / "vit")
    rng = np.random.default_rng(0)
    for name, shift in (("cat", 0), ("dog", 120)):
        (root / "photos" / name).mkdir(parents=True)
        for i in range(images_per_class):
            pixels = rng.integers(0, 136, (12, 12, 3)) + shift
            (root / "photos" / name / f"{i}.png").write_bytes(png_bytes(pixels))
    return str(root / "photos")
