"""Serve a saved model over HTTP on Ray Serve, with `predict`'s records.

`serve_application` returns a Ray Serve application (for users who compose their own); ``hydra-ens
serve`` runs it. The JSON API:

- ``POST /predict`` with ``{"inputs": "a text"}`` or ``{"inputs": ["a text", ...]}`` (for an image
  model, each input is an image file's bytes in base64: PNG, JPEG, anything Pillow reads):
  ``{"records": [...]}``, one record per input, in order, as ``predict`` writes it (without its
  ``id``);
- ``GET /healthz``: ``{"status": "ok"}`` once the model is loaded (a replica answers nothing
  before);
- ``GET /info``: the model, its classes, its calibration, the precision and the limits;
- ``GET /docs`` and ``GET /openapi.json``: the OpenAPI schema, from FastAPI.

Concurrent requests are batched (``@serve.batch``: at most ``max_batch_size`` inputs, waiting at
most ``batch_wait_ms`` for a batch to fill). A record depends on the other texts of its batch only
through the padding to the batch's longest text: within the precision's rounding
(docs/serving.md); images are scored with the batch's images of their size. A request that
breaks the API (malformed JSON, no ``inputs``, an empty text, more than `MAX_INPUTS` inputs, a
text over `MAX_CHARS` characters, an image that is not base64, over `MAX_IMAGE_BYTES` or
`MAX_IMAGE_PIXELS`, or not readable) gets a 4xx answer whose ``error`` is one line naming the
field; an internal failure a 500 whose ``error`` names an id the server's log explains, never a
traceback."""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations (``Request``,
# imported where the application is made) as objects

import asyncio
import logging
import uuid
from typing import Any

import numpy as np

from ..errors import InputError
from .scoring import ModelWorker

MAX_INPUTS = 256
"""The most texts one request may carry."""
MAX_CHARS = 20_000
"""The most characters one text may hold (the model reads its first ``max_length`` tokens)."""
MAX_IMAGE_BYTES = 10_000_000
"""The most bytes one image file may hold (decoded from base64)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels one image may hold (checked before its pixels are decoded)."""

PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "inputs": {
                            "description": "a text or a list of texts; for an image model, image files "
                            "in base64 (PNG, JPEG, ...)",
                            "oneOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "string"}, "maxItems": MAX_INPUTS},
                            ],
                        }
                    },
                }
            }
        },
    }
}
"""The body of ``POST /predict``, for the OpenAPI schema."""

logger = logging.getLogger("hydra_ensembles.serve")

__all__ = ["MAX_CHARS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_INPUTS", "serve_application"]


def require_serve() -> Any:
    """The ``ray.serve`` module; InputError naming the extra where it is not installed."""
    try:
        from ray import serve
    except ImportError:
        raise InputError(
            'serving needs Ray Serve, which the core install leaves out: pip install "hydra-ensembles[ray]"'
        ) from None
    return serve


class _Model(ModelWorker):
    """The model a replica serves: records for a batch of texts, or of images."""

    def __init__(self, model: str, settings: dict[str, Any]) -> None:
        from ..calibration import saved_calibration
        from ..data.labels import model_class_names
        from ..data.registry import saved_length
        from ..models import takes_images
        from ..precision import resolve_precision

        super().__init__(model, {**settings, "preprocessor": None})
        self.vision = takes_images(self.model)
        if self.preprocessor is None and not self.vision:
            raise InputError(
                f"{model} was saved without a tokenizer: serve takes a text model saved with one"
            )
        self.calibration = saved_calibration(self.model)
        self.classes = model_class_names(self.model)
        self.max_length = settings["max_length"] or saved_length(self.model) or 128
        self.precision = resolve_precision(settings["precision"], "cpu")
        self.info = {
            "model": model,
            "classes": self.classes,
            "calibration": self.calibration.describe() if self.calibration is not None else None,
            "precision": f"{self.precision.name} ({self.precision.reason})",
            "inputs": "images (base64 files)" if self.vision else "texts",
            "max_length": self.max_length,
            "limits": {
                "inputs_per_request": MAX_INPUTS,
                "characters_per_text": MAX_CHARS,
                "bytes_per_image": MAX_IMAGE_BYTES,
                "pixels_per_image": MAX_IMAGE_PIXELS,
            },
            "batching": {
                "max_batch_size": settings["max_batch_size"],
                "batch_wait_ms": settings["batch_wait_ms"],
            },
        }

    def records(self, inputs: list[Any]) -> list[dict[str, Any]]:
        """The records of a batch of texts, or of images (C, H, W) in [0, 1] (`checked_inputs`):
        images of one size are scored together, as `predict` scores a folder of them."""
        if not self.vision:
            from ..data.text import TextDataset

            return self._records(
                TextDataset(inputs, [0] * len(inputs), [str(i) for i in range(len(inputs))], [])
            )
        from ..data.images import ImageDataset

        out: list[dict[str, Any]] = [{} for _ in inputs]
        for shape in dict.fromkeys(image.shape for image in inputs):
            places = [i for i, image in enumerate(inputs) if image.shape == shape]
            images = np.stack([inputs[i] for i in places])
            for place, row in zip(
                places,
                self._records(ImageDataset(images, [0] * len(places), [str(i) for i in places], [])),
                strict=True,
            ):
                out[place] = row
        return out

    def _records(self, dataset: Any) -> list[dict[str, Any]]:
        from ..data import model_batches
        from ..evaluation.uncertainty import predict_records

        _, batches = model_batches(
            dataset, self.model, self.preprocessor, len(dataset), self.max_length, False
        )
        _, rows, _ = predict_records(
            self.model, dataset, batches, self.calibration, self.classes, precision=self.precision.name,
            progress=False,
        )  # fmt: skip
        return [{k: v for k, v in row.items() if k != "id"} for row in rows]


def check_servable(model: str) -> None:
    """InputError, before any server starts, where ``model`` is not a saved model folder (a text
    model with its tokenizer, or an image model: what a replica loads)."""
    from pathlib import Path

    from ..loading import load_any, load_preprocessor
    from ..models import takes_images

    if not Path(model).is_dir():
        raise InputError(f"{model} is not a saved model folder")
    if load_preprocessor(model) is None and not takes_images(load_any(model)):
        raise InputError(f"{model} was saved without a tokenizer: serve takes a text model saved with one")


def checked_inputs(body: Any, images: bool = False) -> list[Any]:
    """The texts of a request's JSON body, or with ``images`` its images decoded (float32
    (C, H, W) in [0, 1], as `predict` reads image files); InputError naming the field that breaks
    the API."""
    what = "image" if images else "text"
    one = f"an {what}" if images else f"a {what}"
    if not isinstance(body, dict) or "inputs" not in body:
        raise InputError(f'the body must be a JSON object with "inputs": {one} or a list of {what}s')
    inputs = body["inputs"]
    values = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(values, list) or not values:
        raise InputError(f'"inputs" must be {one} or a non-empty list of {what}s')
    if len(values) > MAX_INPUTS:
        raise InputError(f'"inputs" holds {len(values)} {what}s; at most {MAX_INPUTS} per request')
    checked = []
    for i, value in enumerate(values):
        field = "inputs" if isinstance(inputs, str) else f"inputs[{i}]"
        if not isinstance(value, str):
            raise InputError(
                f"{field} is a {type(value).__name__}, not a {'base64 image' if images else 'text'}"
            )
        if not value.strip():
            raise InputError(f"{field} is empty")
        checked.append(_image(value, field) if images else _text(value, field))
    return checked


def _text(text: str, field: str) -> str:
    if len(text) > MAX_CHARS:
        raise InputError(f"{field} holds {len(text)} characters; at most {MAX_CHARS}")
    return text


def _image(encoded: str, field: str) -> np.ndarray:
    """An image file in base64 decoded and read as `predict` reads image files (`read_image`)."""
    import base64
    import binascii
    import io

    from ..data.images import read_image

    if len(encoded) > 4 * (MAX_IMAGE_BYTES // 3 + 1):
        raise InputError(f"{field} holds over {MAX_IMAGE_BYTES} bytes of image; at most {MAX_IMAGE_BYTES}")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"{field} is not base64 (an image file's bytes, base64-encoded)") from None
    return read_image(io.BytesIO(data), name=field, max_pixels=MAX_IMAGE_PIXELS)


async def _answer(score: Any, request: Any, images: bool = False) -> Any:
    """``POST /predict``'s answer: the records of the request's texts or ``images`` (each scored
    by ``score``, batched with other requests' inputs), or a one-line error."""
    from fastapi.responses import JSONResponse

    try:
        texts = checked_inputs(await request.json(), images)
    except InputError as exc:
        return JSONResponse({"error": str(exc)}, status_code=422)
    except ValueError as exc:  # the body is not JSON
        return JSONResponse({"error": f"the body is not JSON: {exc}"}, status_code=400)
    try:
        records = await asyncio.gather(*(score(text) for text in texts))
    except Exception:
        failure = uuid.uuid4().hex[:12]
        logger.exception("request %s failed", failure)
        return JSONResponse(
            {"error": f"internal error {failure}: the server's log explains it"}, status_code=500
        )
    return JSONResponse({"records": records})


def serve_application(
    model: str,
    *,
    replicas: int = 1,
    max_batch_size: int = 32,
    batch_wait_ms: float = 10.0,
    precision: str = "auto",
    max_length: int | None = None,
    threads: int = 1,
) -> Any:
    """The Ray Serve application serving the saved model ``model`` (texts or images; a folder every
    node can read) with ``replicas`` replicas of one CPU, each computing with ``threads`` threads in
    ``precision`` (``auto``: resolved on its node) and cutting texts at ``max_length`` tokens
    (default: the length the model was saved with). Run it with ``ray.serve.run``."""
    serve = require_serve()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI(title="hydra-ensembles", description="Calibrated predictions with an OOD flag")
    settings = {
        "precision": precision,
        "max_length": max_length,
        "threads": threads,
        "max_batch_size": max_batch_size,
        "batch_wait_ms": batch_wait_ms,
    }

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=1000)
    @serve.ingress(api)
    class HydraServer:
        def __init__(self) -> None:
            self.served = _Model(model, settings)
            self.score.set_max_batch_size(max_batch_size)
            self.score.set_batch_wait_timeout_s(batch_wait_ms / 1000)

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
        async def score(self, inputs: list[Any]) -> list[dict[str, Any]]:
            return self.served.records(list(inputs))

        @api.post("/predict", openapi_extra=PREDICT_BODY)
        async def predict(self, request: Request) -> JSONResponse:
            return await _answer(self.score, request, self.served.vision)

        @api.get("/healthz")
        async def healthz(self) -> dict[str, str]:
            return {"status": "ok"}

        @api.get("/info")
        async def info(self) -> dict[str, Any]:
            return self.served.info

    return HydraServer.bind()
