"""Images over HTTP without a server: a request's base64 image files decoded as `predict` reads
image files, the bad ones refused in one line naming the field (not base64, unreadable, too many
pixels, not a string), and a replica's records of a batch of images: `predict`'s records of the
same files, and for images of two sizes in one batch, each size's records as if alone."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

from hydra_cli import main
from hydra_ensembles.data.images import read_image
from hydra_ensembles.distributed import serve
from hydra_ensembles.errors import InputError
from tests.factories import png_bytes


def _encoded(path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_a_requests_images_are_read_as_predict_reads_files_and_bad_ones_refused_in_one_line(vit):
    file = vit / "photos" / "dog" / "3.png"
    (image,) = serve.checked_inputs({"inputs": _encoded(file)}, images=True)
    assert image.dtype == np.float32 and np.array_equal(image, read_image(file))
    huge = base64.b64encode(png_bytes(np.zeros((4097, 4096)))).decode()
    bad = [
        ({"inputs": ["not base64!"]}, "inputs[0] is not base64"),
        ({"inputs": [base64.b64encode(b"not an image").decode()]}, "inputs[0] is not a readable image"),
        ({"inputs": [_encoded(file), huge]}, "inputs[1] is 4096 x 4097 pixels; at most 16777216"),
        ({"inputs": [{"image": "x"}]}, "inputs[0] is a dict, not a base64 image"),
        ({"inputs": ""}, "inputs is empty"),
        ({"texts": []}, '"inputs": an image or a list of images'),
    ]
    for body, message in bad:
        with pytest.raises(InputError, match=None) as caught:
            serve.checked_inputs(body, images=True)
        assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_replica_gives_predicts_records_of_images_and_each_size_its_own(vit, tmp_path):
    """The replica's records of the folder's images in one batch, against predict on the folder
    (the same batch of all of them: the same numbers); two sizes in one batch: each size's
    records exactly as in a batch of that size alone."""
    model = serve._Model(str(vit / "calibrated"), {"precision": "fp32", "max_length": None, "threads": 1,
                                                  "max_batch_size": 32, "batch_wait_ms": 10})  # fmt: skip
    assert model.vision and model.preprocessor is not None
    files = sorted((vit / "photos").glob("*/*.png"))
    images = serve.checked_inputs({"inputs": [_encoded(f) for f in files]}, images=True)
    out = tmp_path / "p.jsonl"
    args = ["predict", str(vit / "calibrated"), "--data", str(vit / "photos"), "--precision", "fp32"]
    assert main([*args, "--batch-size", "64", "--out", str(out)]) == 0
    expected = [
        {k: v for k, v in json.loads(line).items() if k != "id"} for line in out.read_text().splitlines()
    ]
    got = model.records(images)
    assert got == expected and "ood_p_value" in got[0]
    large = [np.repeat(np.repeat(image, 2, 1), 2, 2) for image in images[:2]]  # 24 x 24
    mixed = model.records([images[0], large[0], images[1], large[1]])
    assert mixed[0::2] == model.records(images[:2]) and mixed[1::2] == model.records(large)


def test_the_http_answer_to_a_bad_image_is_one_line(vit):
    class Request:
        def __init__(self, body):
            self.body = body

        async def json(self):
            return self.body

    async def echo(image):
        return {"shape": list(image.shape)}

    answer = asyncio.run(serve._answer(echo, Request({"inputs": [_encoded(vit / "photos/cat/0.png")]}), True))
    assert answer.status_code == 200 and json.loads(answer.body) == {"records": [{"shape": [3, 12, 12]}]}
    answer = asyncio.run(serve._answer(echo, Request({"inputs": ["%%%"]}), True))
    assert answer.status_code == 422 and json.loads(answer.body)["error"].startswith(
        "inputs[0] is not base64"
    )
