"""The demos' prediction cache: computed once per (model, inputs, precision), persisted so that an
interrupted or repeated run resumes, and never serving predictions of another model or input."""

import numpy as np
import torch

import hydra_ensembles as he
from hydra_ensembles.evaluation import predict
from hydra_ensembles.hashing import module_fingerprint
from hydra_experiments import PredictionCache
from tests.factories import labelled, text_inputs, tiny_bert


def _data(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [labelled(text_inputs(seed=seed + s), seed=seed + s) for s in range(2)]


def _counting(model: torch.nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_stored_predictions_are_reused_by_a_new_cache_without_running_the_model(tmp_path):
    model, data = tiny_bert(), _data()
    first = PredictionCache(tmp_path).predict(model, data, "test", progress=False)
    np.testing.assert_array_equal(first.member_logits, predict(model, data, progress=False).member_logits)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    calls = _counting(model)
    again = PredictionCache(tmp_path).predict(model, data, "test", progress=False)
    assert calls[0] == 0
    np.testing.assert_array_equal(again.member_logits, first.member_logits)
    np.testing.assert_array_equal(again.labels, first.labels)


def test_a_changed_weight_input_or_precision_is_predicted_again(tmp_path):
    model, data = tiny_bert(), _data()
    kwargs = {"precision": "fp32", "progress": False}
    first = PredictionCache(tmp_path).predict(model, data, "test", **kwargs)
    with torch.no_grad():
        model.classifier.bias[0] += 1.0
    changed = PredictionCache(tmp_path).predict(model, data, "test", **kwargs)
    np.testing.assert_allclose(changed.member_logits[..., 0], first.member_logits[..., 0] + 1.0, atol=1e-5)
    other = PredictionCache(tmp_path).predict(model, _data(seed=5), "test", **kwargs)
    assert not np.allclose(other.member_logits, changed.member_logits)
    for precision in ("bf16", "fp16"):  # every precision has its own entry
        low = PredictionCache(tmp_path).predict(model, data, "test", precision=precision, progress=False)
        assert not np.array_equal(low.member_logits, changed.member_logits)
    assert len(list(tmp_path.glob("*.safetensors"))) == 5


def test_fingerprints_separate_models_that_differ_only_in_structure_or_buffers():
    model = tiny_bert()
    fused_a = he.fuse(model, [he.HeadSet({0: [0]}), he.HeadSet({1: [1]})])
    fused_b = he.fuse(model, [he.HeadSet({0: [1]}), he.HeadSet({1: [1]})])
    assert module_fingerprint(model) == module_fingerprint(model)
    assert module_fingerprint(fused_a) != module_fingerprint(fused_b)
    assert module_fingerprint(model) != module_fingerprint(tiny_bert(seed=1))


def test_ensembles_are_stored_member_by_member_and_mc_dropout_never(tmp_path):
    model, other, data = tiny_bert(), tiny_bert(seed=1), _data()
    cache = PredictionCache(tmp_path)
    both = cache.predict([model, other], data, "test", progress=False)
    assert both.num_members == 2 and len(list(tmp_path.glob("*.safetensors"))) == 2
    torch.manual_seed(0)
    cache.predict(model, data, "test", mc_samples=2, progress=False)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_without_a_folder_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    PredictionCache().predict(tiny_bert(), _data(), "test", progress=False)
    assert not list(tmp_path.rglob("*"))


class _Scaled(torch.nn.Module):
    """A module whose output depends on a plain attribute that its repr does not show."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.scale = scale

    def forward(self, x):
        return self.scale * self.linear(x)


def test_fingerprints_see_plain_settings_but_not_the_training_mode():
    torch.manual_seed(0)
    model = _Scaled(1.0)
    before = module_fingerprint(model)
    assert module_fingerprint(model.train(False)) == before
    model.scale = 2.0
    assert module_fingerprint(model) != before
