"""`DualEncoderClassifier`: zero-shot classification with a dual encoder (paper section 5.3).

An input tower embeds the input (an image for CLIP, a text for a sentence encoder); a label tower
embeds one prompt per class and template ("A photo of a {}."); class embeddings are the mean of
the normalised prompt embeddings over templates, normalised again (CLIP's prompt ensembling);
logits are ``logit_scale`` x cosine similarity (+ ``logit_bias``: SigLIP's sigmoid logits). No
training is involved. Probabilities are the softmax over the classes of those logits for every
family, SigLIP included (its bias then cancels): the ensemble averages distributions over the
classes and every metric is the softmax classifier's, as for CLIP; SigLIP's per-class sigmoids,
which need not sum to one, are not used.

The classifier is an ordinary module with ``logits`` and ``loss`` (labels = class indices), so
Taylor scoring, circuit extraction, pruning and evaluation treat it like any classifier. Its heads
are the heads of both towers as one pool (``heads="both"``: input tower layers first, then label
tower layers) or of the input tower only (``heads="input"``, paper appendix E.3.2; the class
embeddings are then computed once and cached).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from ..errors import InputError
from ..hashing import state_signature
from ..saving.metadata import read_metadata
from .towers import EncoderTower, cosine_logits, normalize

HeadPool = Literal["both", "input"]
MODEL_TYPE = "hydra_dual_encoder"
SENTENCE_LOGIT_SCALE = 20.0
"""Default scale for sentence encoders: the scale of the contrastive loss
(MultipleNegativesRankingLoss, scale 20) that all-MiniLM-L6-v2 and all-mpnet-base-v2 were
trained with. Temperature scaling refits it on ID validation data in the "+ TS" rows."""


def check_template(template: str) -> None:
    """A prompt template holds exactly one ``{}`` (the class name) and no other field (``{{`` and
    ``}}`` write braces); ValueError otherwise."""
    import string

    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        reason = f"template {template!r} is malformed ({exc})"
        raise InputError(f"{reason}: write braces as {{{{ and }}}}") from None
    if fields != [""]:
        raise InputError(
            f"template {template!r} must hold exactly one '{{}}' for the class name and no other field, "
            f"found {['{' + f + '}' for f in fields] or 'none'}"
        )


@dataclass
class DualEncoderConfig:
    """What a dual-encoder classifier is: classes, templates, scale, poolings and head pool."""

    classes: list[str]
    templates: list[str] = field(default_factory=lambda: ["{}"])
    logit_scale: float = SENTENCE_LOGIT_SCALE
    input_pooling: str = "mean"
    label_pooling: str = "mean"
    heads: HeadPool = "both"
    model_type: str = MODEL_TYPE
    logit_bias: float = 0.0

    def __post_init__(self) -> None:
        if len(self.classes) < 2:
            raise InputError(f"a zero-shot classifier needs at least two class names, got {self.classes}")
        if any(not str(c).strip() for c in self.classes):
            raise InputError(f"class names must not be empty (a trailing comma?), got {self.classes}")
        if len(set(self.classes)) != len(self.classes):
            raise InputError(f"class names must be distinct, got {self.classes}")
        if not self.templates:
            raise InputError("give at least one template")
        for template in self.templates:
            check_template(template)
        if self.heads not in ("both", "input"):
            raise InputError(f"heads must be 'both' or 'input', got {self.heads!r}")
        if not self.logit_scale > 0:
            raise InputError(f"logit_scale must be positive, got {self.logit_scale}")

    @property
    def num_labels(self) -> int:
        return len(self.classes)

    @property
    def id2label(self) -> dict[int, str]:
        """Class names by index, as Hugging Face configs name them."""
        return dict(enumerate(self.classes))

    def prompts(self) -> list[str]:
        """Every class's prompts, class-major: row ``c * T + t`` is template t of class c."""
        return [template.format(name) for name in self.classes for template in self.templates]

    def to_dict(self) -> dict[str, Any]:
        """The fields, plus the library's metadata recorded on the config (`saving.metadata`)."""
        return {**asdict(self), **read_metadata(self).to_config()}


class DualEncoderClassifier(nn.Module):
    """Zero-shot classifier over an input tower and a label tower (see the module docstring).

    ``prompt_inputs``: the label tower's inputs for `DualEncoderConfig.prompts` (tokenised).
    """

    is_dual_encoder = True

    def __init__(
        self,
        input_tower: EncoderTower,
        label_tower: EncoderTower,
        prompt_inputs: dict[str, torch.Tensor],
        config: DualEncoderConfig,
    ) -> None:
        super().__init__()
        rows = {int(v.shape[0]) for v in prompt_inputs.values() if isinstance(v, torch.Tensor)}
        expected = config.num_labels * len(config.templates)
        if rows != {expected}:
            raise InputError(
                f"prompt inputs must have {expected} rows ({config.num_labels} classes x "
                f"{len(config.templates)} templates), got {sorted(rows)}"
            )
        self.input_tower = input_tower
        self.label_tower = label_tower
        self.config = config
        self.prompt_keys = tuple(prompt_inputs)
        for name, value in prompt_inputs.items():
            self.register_buffer(f"prompt_{name}", value)
        self._cache: tuple[tuple, torch.Tensor] | None = None

    @property
    def prompt_inputs(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"prompt_{name}") for name in self.prompt_keys}

    @property
    def tower_paths(self) -> tuple[str, ...]:
        """The towers whose heads are pruned, as paths of their Hugging Face models."""
        return ("input_tower.model", "label_tower.model")[: 2 if self.config.heads == "both" else 1]

    # ----------------------------------------------------------------- embeddings
    def class_embeddings_from(self, prompt_embeddings: torch.Tensor) -> torch.Tensor:
        """(..., C, D) unit class embeddings from prompt embeddings (..., C*T, D)."""
        per_prompt = normalize(prompt_embeddings).unflatten(-2, (self.config.num_labels, -1))
        return normalize(per_prompt.mean(-2))

    def class_embeddings(self) -> torch.Tensor:
        """(C, D) unit class embeddings. With ``heads="input"`` the label tower is fixed: they are
        computed once and reused until any label-tower weight or prompt changes."""
        if self.config.heads == "both":
            return self.class_embeddings_from(self.label_tower(**self.prompt_inputs))
        signature = state_signature({**self.label_tower.state_dict(), **self.prompt_inputs})
        if signature is None or self._cache is None or self._cache[0] != signature:
            with torch.no_grad():
                embeddings = self.class_embeddings_from(self.label_tower(**self.prompt_inputs))
            if signature is None:
                return embeddings
            self._cache = (signature, embeddings)
        return self._cache[1]

    def logits_from(self, input_embeddings: torch.Tensor, class_embeddings: torch.Tensor) -> torch.Tensor:
        """``logit_scale`` x cosine + ``logit_bias``: inputs (..., B, D) against classes (..., C, D)
        -> (..., B, C)."""
        return cosine_logits(
            input_embeddings, class_embeddings, self.config.logit_scale, self.config.logit_bias
        )

    def features_and_logits(self, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The input's feature, its unit embedding (B, D), and the logits (B, C) its output
        layer `output_head` maps it to."""
        embeddings = self.input_tower(**inputs)
        return normalize(embeddings), self.logits_from(embeddings, self.class_embeddings())

    @torch.no_grad()
    def output_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The affine map from unit input embeddings to logits, ``(W (C, D), b (C,))`` in float64:
        ``logit_scale`` x the unit class embeddings, and ``logit_bias``."""
        weight = self.config.logit_scale * self.class_embeddings().double()
        return weight, torch.full((weight.shape[0],), float(self.config.logit_bias), dtype=torch.float64)

    def forward(self, labels: torch.Tensor | None = None, **inputs: Any) -> SequenceClassifierOutput:
        logits = self.logits_from(self.input_tower(**inputs), self.class_embeddings())
        loss = None if labels is None else F.cross_entropy(logits, labels.to(logits.device))
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def extra_repr(self) -> str:
        c = self.config
        scale = f"logit_scale={c.logit_scale}"
        return f"classes={c.classes}, templates={len(c.templates)}, {scale}, heads={c.heads!r}"


# --------------------------------------------------------------------------- constructors
def tokenize_prompts(
    tokenizer, config: DualEncoderConfig, max_length: int = 77, padding: bool | str = True
) -> dict[str, torch.Tensor]:
    """The label tower's inputs for every prompt of ``config`` (``padding="max_length"`` for a
    tower that pools the last position, SigLIP's)."""
    encoded = tokenizer(
        config.prompts(), padding=padding, truncation=True, max_length=max_length, return_tensors="pt"
    )
    return dict(encoded)


def from_sentence_encoder(
    model: nn.Module,
    tokenizer,
    classes: Sequence[str],
    templates: Sequence[str] = ("{}",),
    logit_scale: float = SENTENCE_LOGIT_SCALE,
    heads: HeadPool = "both",
    pooling: str = "mean",
) -> DualEncoderClassifier:
    """A zero-shot classifier over a sentence encoder (a BERT-family or MPNet base model): the
    input and label towers start as two copies of ``model`` and are pruned separately."""
    config = DualEncoderConfig(list(classes), list(templates), float(logit_scale), pooling, pooling, heads)
    base = copy.deepcopy(model).eval()
    towers = EncoderTower(base, pooling), EncoderTower(copy.deepcopy(base), pooling)
    return DualEncoderClassifier(*towers, tokenize_prompts(tokenizer, config), config).eval()


def from_clip(
    clip: nn.Module,
    classes: Sequence[str],
    templates: Sequence[str] = ("A photo of a {}.",),
    tokenizer=None,
    prompt_inputs: dict[str, torch.Tensor] | None = None,
    heads: HeadPool = "both",
) -> DualEncoderClassifier:
    """A zero-shot classifier over a Hugging Face ``CLIPModel`` (vision tower for inputs, text
    tower for labels, CLIP's learned logit scale). Give a ``tokenizer`` or the tokenised
    ``prompt_inputs`` of `DualEncoderConfig.prompts`."""
    from transformers import CLIPTextModelWithProjection, CLIPVisionModelWithProjection

    if type(clip).__name__ != "CLIPModel":
        raise TypeError(f"from_clip needs a transformers CLIPModel, got {type(clip).__name__}")
    scale = float(clip.logit_scale.detach().exp())
    config = DualEncoderConfig(list(classes), list(templates), scale, "image_embeds", "text_embeds", heads)
    vision_config = copy.deepcopy(clip.config.vision_config)
    text_config = copy.deepcopy(clip.config.text_config)
    vision_config.projection_dim = text_config.projection_dim = clip.config.projection_dim
    vision = CLIPVisionModelWithProjection(vision_config)
    vision.vision_model = copy.deepcopy(clip.vision_model)
    vision.visual_projection = copy.deepcopy(clip.visual_projection)
    text = CLIPTextModelWithProjection(text_config)
    text.text_model = copy.deepcopy(clip.text_model)
    text.text_projection = copy.deepcopy(clip.text_projection)
    dtype = clip.logit_scale.dtype
    vision, text = vision.to(dtype).eval(), text.to(dtype).eval()
    if prompt_inputs is None:
        if tokenizer is None:
            raise InputError("from_clip needs a tokenizer or prompt_inputs")
        prompt_inputs = tokenize_prompts(tokenizer, config)
    towers = EncoderTower(vision, "image_embeds"), EncoderTower(text, "text_embeds")
    return DualEncoderClassifier(*towers, dict(prompt_inputs), config).eval()


def from_siglip(
    siglip: nn.Module,
    classes: Sequence[str],
    templates: Sequence[str] = ("This is a photo of {}.",),
    tokenizer=None,
    prompt_inputs: dict[str, torch.Tensor] | None = None,
    heads: HeadPool = "both",
) -> DualEncoderClassifier:
    """A zero-shot classifier over a Hugging Face ``SiglipModel`` or ``Siglip2Model``: its vision
    tower (pooled by its attention-pooling head) for inputs, its text tower (last token,
    projected) for labels, and its learned logit scale and bias. Give a ``tokenizer`` (prompts
    are padded to the text tower's full length, as SigLIP was trained) or the tokenised
    ``prompt_inputs``. SigLIP 2's images come as patches with ``pixel_attention_mask`` and
    ``spatial_shapes`` (its image processor's outputs), which the input tower takes as given."""
    if type(siglip).__name__ not in ("SiglipModel", "Siglip2Model"):
        raise TypeError(
            f"from_siglip needs a transformers SiglipModel or Siglip2Model, got {type(siglip).__name__}"
        )
    scale, bias = float(siglip.logit_scale.detach().exp()), float(siglip.logit_bias.detach())
    config = DualEncoderConfig(
        list(classes), list(templates), scale, "image_pooler", "text_pooler", heads, logit_bias=bias
    )
    vision, text = copy.deepcopy(siglip.vision_model), copy.deepcopy(siglip.text_model)
    dtype = siglip.logit_scale.dtype
    vision, text = vision.to(dtype).eval(), text.to(dtype).eval()
    if prompt_inputs is None:
        if tokenizer is None:
            raise InputError("from_siglip needs a tokenizer or prompt_inputs")
        length = siglip.config.text_config.max_position_embeddings
        prompt_inputs = tokenize_prompts(tokenizer, config, max_length=length, padding="max_length")
    towers = EncoderTower(vision, "image_pooler"), EncoderTower(text, "text_pooler")
    return DualEncoderClassifier(*towers, dict(prompt_inputs), config).eval()


def load_dual_encoder(
    name_or_path: str,
    classes: Sequence[str],
    templates: Sequence[str] | None = None,
    logit_scale: float | None = None,
    heads: HeadPool = "both",
) -> DualEncoderClassifier:
    """A zero-shot classifier from a Hugging Face checkpoint (hub id or directory): a ``CLIPModel``
    (templates default to "A photo of a {}.", CLIP's scale) or a sentence encoder in the BERT
    family (mean pooling; templates default to "{}", scale to `SENTENCE_LOGIT_SCALE`)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from ..models import resolve_model_path

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if config.model_type == "clip":
        from transformers import CLIPModel

        if logit_scale is not None:
            raise InputError("a CLIP model brings its own learned logit scale; do not give one")
        clip = CLIPModel.from_pretrained(path).eval()
        return from_clip(clip, classes, templates or ("A photo of a {}.",), tokenizer=tokenizer, heads=heads)
    if config.model_type in ("siglip", "siglip2"):
        from transformers import Siglip2Model, SiglipModel

        if logit_scale is not None:
            raise InputError("a SigLIP model brings its own learned logit scale and bias; do not give one")
        siglip = (SiglipModel if config.model_type == "siglip" else Siglip2Model).from_pretrained(path).eval()
        templates = templates or ("This is a photo of {}.",)
        return from_siglip(siglip, classes, templates, tokenizer=tokenizer, heads=heads)
    encoder = AutoModel.from_pretrained(path).eval()
    scale = SENTENCE_LOGIT_SCALE if logit_scale is None else logit_scale
    return from_sentence_encoder(encoder, tokenizer, classes, templates or ("{}",), scale, heads)
