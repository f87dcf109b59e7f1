"""The embedded benchmarks: deterministic, disjoint splits and the documented OOD roles."""

import pytest

from hydra_experiments.tasks import NEAR_CLASSES, load_image_task, load_task


@pytest.mark.slow  # README's test command: under ten minutes; CI runs it (-m slow)
def test_image_task_splits_are_disjoint_deterministic_and_hold_out_near_classes():
    limits = {"train_limit": 300, "val_limit": 50, "test_limit": 80, "ood_limit": 20, "shift_limit": 5}
    task = load_image_task(**limits)
    again = load_task("image", **limits)
    assert (
        task.train.ids == again.train.ids
        and task.ood_test["textures"][1].ids == again.ood_test["textures"][1].ids
    )
    assert len(task.classes) == 8 and not set(NEAR_CLASSES) & set(task.classes)
    assert set(task.train.labels) <= set(range(8)) and len(set(task.train.labels)) == 8
    assert not set(task.train.ids) & set(task.val.ids)  # both from Fashion-MNIST's training split
    assert all(i.startswith("train/") for i in task.val.ids) and all(
        i.startswith("test/") for i in task.test.ids
    )
    near = task.ood_test["fashion-held-out"][1]
    assert {near.classes[y] for y in near.labels} <= set(NEAR_CLASSES) and not set(near.ids) & set(
        task.test.ids
    )
    assert {k for k, _ in task.ood_test.values()} == {"near", "far"} and len(task.ood_val) == 500
    assert not any(i.startswith("elpv/") for _, d in task.ood_test.values() for i in d.ids)
    assert len(task.shift) == 6 * 5 and all(len(d) == 5 for d in task.shift.values())
    assert set(task.describe()) == {
        "ID",
        "OOD test",
        "OOD validation (circuits, the flag score's choice)",
        "shift",
    }


def test_unknown_task():
    import pytest

    with pytest.raises(ValueError, match="unknown task"):
        load_task("audio")
