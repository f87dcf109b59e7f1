"""Pipelines that return, per input, the calibrated prediction with its uncertainty and OOD flag.

Importing ``hydra_ensembles`` registers two pipeline tasks with ``transformers``:

    classify = pipeline("hydra-text-classification", model="built/hydra")
    classify("the match ended in a draw")
    # {'label': 'sport', 'score': 0.91, 'predicted': 'sport', 'confidence': 0.91, 'p_sport': 0.91,
    #  ..., 'entropy': 0.31, 'mutual_information': 0.02, 'members_agreeing': 1.0,
    #  'ood_score_msp': 0.09, 'flagged': False}

and ``"hydra-image-classification"`` alike. Each record is `Calibration.records`' (the same fields
``hydra-ens predict`` writes), with ``label`` and ``score`` as the standard classification
pipelines name them. The model is a saved Hydra model, member or ensemble (through
`HydraPreTrainedModel`) or any Hugging Face classifier (an ensemble of one; a calibration
``hydra-ens finetune --val-data`` recorded in it is used). Without a calibration the probabilities
are at temperature 1 and no record holds ``flagged``.

The forward pass computes as ``hydra-ens predict`` does on the same machine (``precision="auto"``:
bf16 where the device computes it natively, the precision ``build`` fits the calibration in);
``pipeline(..., precision="fp32")`` computes in fp32 (`modeling.serving_precision`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
import weakref
from typing import Any

from transformers import (
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    ImageClassificationPipeline,
    TextClassificationPipeline,
)
from transformers.pipelines import PIPELINE_REGISTRY

from ..calibration.calibration import Calibration
from ..calibration.fit import saved_calibration
from ..data.registry import position_limit, saved_length
from ..data.text import check_text_input
from ..errors import InputError
from ..evaluation.predict import Predictions
from ..evaluation.uncertainty import per_example
from ..inputs import check_padding
from ..ood.features import FeatureError, FeatureTap
from ..ood.storage import read_statistics, recorded_digest
from ..precision import check_precision
from ..saving.formats import check_folder_checksums
from ..saving.metadata import read_metadata
from .modeling import HydraPreTrainedModel, serving_precision

TEXT_TASK = "hydra-text-classification"
IMAGE_TASK = "hydra-image-classification"

__all__ = ["IMAGE_TASK", "TEXT_TASK", "HydraImageClassificationPipeline", "HydraTextClassificationPipeline"]


class _UncertaintyRecords:
    """Postprocessing shared by both pipelines: one `per_example` record per input."""

    model: Any

    def __init__(self, *args: Any, precision: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precision = check_precision(precision or getattr(self.model, "precision", "auto"))
        if isinstance(self.model, HydraPreTrainedModel):
            self.model.precision = self.precision
        folder = getattr(self.model, "name_or_path", "") or ""
        if not isinstance(self.model, HydraPreTrainedModel) and os.path.isdir(folder):
            check_folder_checksums(folder)  # a folder finetune wrote, changed since: refused

    def __call__(self, inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
        for size in (kwargs.get("batch_size"), getattr(self, "_batch_size", None)):
            if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise InputError(f"batch_size must be a positive whole number, got {size!r}")
        return super().__call__(inputs, *args, **kwargs)

    def _calibration(self) -> Calibration | None:
        if not hasattr(self, "_cached_calibration"):
            model = self.model
            if not isinstance(model, HydraPreTrainedModel) and read_metadata(model).statistics is None:
                folder = getattr(model, "name_or_path", "") or ""
                if recorded_digest(model) and os.path.isdir(folder):  # a classifier loaded by transformers
                    read_statistics(model, folder)
            self._cached_calibration = (
                model.calibration if isinstance(model, HydraPreTrainedModel) else saved_calibration(model)
            )
        return self._cached_calibration

    def _forward(self, model_inputs: dict[str, Any], **kwargs: Any) -> Any:
        """The model's outputs; a plain Hugging Face classifier's features are recorded on the way
        (a Hydra model returns its members' own, computed in its ``precision``, the pipeline's)."""
        model = self.model
        if isinstance(model, HydraPreTrainedModel):
            return super()._forward(model_inputs, **kwargs)
        try:
            tap = FeatureTap(model)
        except (FeatureError, TypeError):  # no single output layer, or a family without adapter
            tap = None
        calibration = self._calibration()
        if tap is not None:
            tap.every_layer = calibration is not None and calibration.flag.reads_layers
        # the tap's hooks sit on the model, which other threads' pipelines may run at once: one
        # forward pass at a time per model, so that each records its own call only
        with _model_lock(model):
            with (
                tap if tap is not None else contextlib.nullcontext(),
                serving_precision(model, self.precision),
            ):
                outputs = super()._forward(model_inputs, **kwargs)
            if tap is not None:
                batch = outputs["logits"].shape[0]
                outputs["features_per_member"] = tap.features(model_inputs, batch).transpose(0, 1)
                if tap.every_layer:
                    layers = tap.layer_features(model_inputs, batch)
                    outputs["layer_features_per_member"] = layers.transpose(0, 1)
        return outputs

    def _sanitize_parameters(self, **kwargs: Any):
        preprocess, forward, _ = super()._sanitize_parameters(**kwargs)
        return preprocess, forward, {}

    def postprocess(self, model_outputs: Any, **_: Any) -> dict[str, Any]:
        per_member = model_outputs.get("logits_per_member")
        features = model_outputs.get("features_per_member")
        layers = model_outputs.get("layer_features_per_member")
        if per_member is None:  # a Hugging Face classifier: an ensemble of one
            per_member = model_outputs["logits"][:, None]
        predictions = Predictions(
            per_member.float().transpose(0, 1).cpu().numpy(),
            member_features=None if features is None else features.float().transpose(0, 1).cpu().numpy(),
            layer_features=None if layers is None else layers.float().transpose(0, 1).cpu().numpy(),
        )
        config = self.model.config
        classes = [str(config.id2label[i]) for i in range(predictions.num_classes)]
        calibration = self._calibration()
        records = (
            calibration.records(predictions, classes) if calibration else per_example(predictions, classes)
        )
        record = records[0]
        return {"label": record["predicted"], "score": record["confidence"], **record}


class HydraTextClassificationPipeline(_UncertaintyRecords, TextClassificationPipeline):
    """``text-classification`` with the uncertainty fields and the OOD flag (one dict per input).
    Each input must be a text that is not blank (anything else is refused in one line, as
    ``hydra-ens predict`` refuses it); texts are cut to the length the model was trained and
    calibrated at (saved with it by ``finetune`` and ``build``), else to its positions, unless
    ``truncation``/``max_length`` say otherwise. A batch padded with another id than
    a decoder classifier's pooling looks for is refused (`inputs.check_padding`: a tokenizer
    other than the one saved with the model)."""

    def preprocess(self, inputs: Any, **tokenizer_kwargs: Any) -> Any:
        check_text_input(inputs)
        model = getattr(self.model, "ensemble", self.model)
        saved = saved_length(model)
        asked = tokenizer_kwargs.get("max_length")
        if saved is not None and asked is not None and asked != saved and not getattr(self, "_told", False):
            self._told = True
            warnings.warn(
                f"the model was calibrated on texts of {saved} tokens and is asked for {asked}: its "
                "temperature, statistics and threshold were fit at the saved length",
                stacklevel=2,
            )
        if "truncation" not in tokenizer_kwargs and "max_length" not in tokenizer_kwargs:
            limit = saved or position_limit(self.tokenizer, model)
            if limit is not None:  # the length the model was fit at, else its positions
                tokenizer_kwargs = {**tokenizer_kwargs, "truncation": True, "max_length": limit}
        return super().preprocess(inputs, **tokenizer_kwargs)

    def _forward(self, model_inputs: dict[str, Any], **kwargs: Any) -> Any:
        model = self.model
        check_padding([model_inputs], getattr(model, "ensemble", model), "the pipeline's batch")
        return super()._forward(model_inputs, **kwargs)


class HydraImageClassificationPipeline(_UncertaintyRecords, ImageClassificationPipeline):
    """``image-classification`` with the uncertainty fields and the OOD flag (one dict per input).
    Each input is an image: a PIL image, an array, or a path or URL of one; anything else (None,
    a text that names no file) is refused in one line."""

    def __call__(self, inputs: Any = None, **kwargs: Any) -> Any:
        for item in inputs if isinstance(inputs, list) else [inputs]:
            _check_image_input(item)
        return super().__call__(inputs, **kwargs)

    def preprocess(self, image: Any, *args: Any, **kwargs: Any) -> Any:
        from PIL import Image

        try:  # a file or URL is read here: what Pillow cannot read safely is refused in one line
            if isinstance(image, str):
                from transformers.image_utils import load_image

                image = load_image(image)
                _check_pixels(image)
            return super().preprocess(image, *args, **kwargs)
        except (OSError, Image.DecompressionBombError) as exc:
            raise InputError(f"{IMAGE_TASK}: not a readable image ({' '.join(str(exc).split())})") from None


def _check_image_input(value: Any) -> None:
    """Refuse what no image loader reads (None, blank strings, texts that are no file or URL) and
    images no model should be served: empty ones (0 pixels), ones past Pillow's decompression-bomb
    limit, arrays of non-finite pixels or float pixels outside [0, 1] (`data.images.unit_pixels`,
    the rule of the command line)."""
    if isinstance(value, str) and value.strip():
        if value.startswith(("http://", "https://", "data:image/")) or os.path.isfile(value):
            return
    elif value is not None and not isinstance(value, str):
        _check_pixels(value)
        return
    raise InputError(
        f"{IMAGE_TASK} takes images (a PIL image, an array, or a path or URL of one), got {value!r:.60}"
    )


def _check_pixels(image: Any) -> None:
    """InputError for an image (a PIL image or an array) with no pixels, too many, or pixel
    values the command line would refuse."""
    import numpy as np
    from PIL import Image

    from ..data.images import unit_pixels

    if isinstance(image, Image.Image):
        width, height = image.size
    else:
        array = np.asarray(image.detach().cpu() if hasattr(image, "detach") else image)
        if array.dtype == object or array.ndim not in (2, 3):
            raise InputError(
                f"{IMAGE_TASK} takes images of (height, width[, channels]) pixels, got {array.shape}"
            )
        height, width = array.shape[:2]
        if np.issubdtype(array.dtype, np.floating):
            if not np.isfinite(array).all():
                raise InputError(
                    f"{IMAGE_TASK}: the image holds pixels that are not finite (NaN or infinite)"
                )
            unit_pixels(array, IMAGE_TASK)
    if width * height == 0:
        raise InputError(f"{IMAGE_TASK}: the image is empty ({width} x {height} pixels)")
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise InputError(
            f"{IMAGE_TASK}: the image has {width * height:,} pixels, past the {limit:,} Pillow reads safely"
        )


_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _model_lock(model: Any) -> threading.Lock:
    """The lock of ``model``'s forward passes under a feature tap (one per model object)."""
    with _LOCKS_LOCK:
        if model not in _LOCKS:
            _LOCKS[model] = threading.Lock()
        return _LOCKS[model]


def register_pipelines() -> None:
    """Register the two tasks with ``transformers.pipeline`` (once)."""
    if TEXT_TASK in PIPELINE_REGISTRY.get_supported_tasks():
        return
    PIPELINE_REGISTRY.register_pipeline(
        TEXT_TASK,
        pipeline_class=HydraTextClassificationPipeline,
        pt_model=AutoModelForSequenceClassification,
        type="text",
    )
    PIPELINE_REGISTRY.register_pipeline(
        IMAGE_TASK,
        pipeline_class=HydraImageClassificationPipeline,
        pt_model=AutoModelForImageClassification,
        type="image",
    )
