"""Serving: saved models through Hugging Face's Auto classes and pipelines, and ONNX export."""

from .modeling import (
    HydraClassifierOutput,
    HydraForImageClassification,
    HydraForSequenceClassification,
    HydraPreTrainedModel,
    register_auto_classes,
)
from .pipelines import (
    IMAGE_TASK,
    TEXT_TASK,
    HydraImageClassificationPipeline,
    HydraTextClassificationPipeline,
    register_pipelines,
)

register_auto_classes()
register_pipelines()

__all__ = [
    "IMAGE_TASK",
    "TEXT_TASK",
    "HydraClassifierOutput",
    "HydraForImageClassification",
    "HydraForSequenceClassification",
    "HydraImageClassificationPipeline",
    "HydraPreTrainedModel",
    "HydraTextClassificationPipeline",
    "register_auto_classes",
    "register_pipelines",
]
