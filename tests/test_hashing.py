"""The digests saved files record keep their layout (older files must still match), and each
digest sees what it claims to."""

import hashlib
import json

import torch
from torch import nn

from hydra_ensembles.hashing import (
    batches_digest,
    config_digest,
    fingerprint,
    json_digest,
    module_fingerprint,
    sha256_file,
)


def test_fingerprint_layout_is_the_one_saved_members_and_calibrations_carry():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.5)
    expected = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        expected.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        expected.update(tensor.numpy().tobytes())
    assert fingerprint(model) == expected.hexdigest()
    with torch.no_grad():
        model.bias.add_(1.0)  # an in-place write is seen despite the per-model cache
    assert fingerprint(model) != expected.hexdigest()


def test_config_digest_ignores_only_its_own_field():
    config = {"b": 1, "a": [1, 2]}
    assert config_digest(config) == hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    assert config_digest({**config, "config_sha256": "x"}) == config_digest(config)
    assert config_digest({**config, "b": 2}) != config_digest(config)


def test_json_digest_is_canonical():
    assert json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1})
    assert json_digest([1, 2]) != json_digest([2, 1])


def test_batches_digest_sees_values_dtypes_and_order():
    one = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([0])}
    two = {"input_ids": torch.tensor([[1, 3]]), "labels": torch.tensor([0])}
    assert batches_digest([one, two]) == batches_digest([dict(one), dict(two)])
    assert batches_digest([one, two]) != batches_digest([two, one])
    assert batches_digest([one]) != batches_digest([{**one, "labels": torch.tensor([0.0])}])
    assert batches_digest([one]) != batches_digest([{**one, "split": "ood"}])


def test_module_fingerprint_sees_settings_beyond_the_weights():
    a, b = nn.Dropout(0.1), nn.Dropout(0.2)
    assert fingerprint(a) == fingerprint(b)  # no weights
    assert module_fingerprint(a) != module_fingerprint(b)


def test_sha256_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (3 << 20))
    assert sha256_file(path) == hashlib.sha256(b"x" * (3 << 20)).hexdigest()
