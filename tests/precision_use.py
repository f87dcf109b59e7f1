"""Which tests compute in the precision `HYDRA_PRECISION` sets: the tests the bf16 and fp16 reruns
of ``scripts/test.sh`` run again.

A resolved precision reaches the numbers only through `Precision.autocast`, `Precision.reduced`
and `Precision.dtype` (prediction, training, Taylor scores, circuit extraction, serving, the
tests that pick a dtype), and depends on `HYDRA_PRECISION` only where ``auto`` resolved it from
that variable (then passed on as such, or by name, as the command line does: resolving it counts
as a use). With ``HYDRA_PRECISION_USES`` naming a folder, every such use appends the running
test's id to a file of its own process in that folder (child processes that a test starts inherit
the variable and the test's id and record alike); `recorded` reads them back. A test that never
uses such a precision computes the same in every precision, so rerunning it in bf16 and fp16
would only repeat the fp32 pass; one that does is selected with no mark to forget.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

USES = "HYDRA_PRECISION_USES"
"""The folder the uses are recorded in (unset: nothing is recorded)."""


def _test_id(precision) -> str | None:
    """The running test's node id (pytest sets ``PYTEST_CURRENT_TEST`` to "<id> (<stage>)"), where
    ``precision``'s use makes the test depend on `HYDRA_PRECISION`: a use of a precision ``auto``
    resolved from that variable, in the test's call or its fixtures' set-up (a test or fixture
    that pins its precision, as the ONNX exports' fp32 checks do, computes alike in every rerun)."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if not current or not precision.reason.startswith("set by"):
        return None
    test, _, stage = current.rpartition(" (")
    return split_group(test)[0] if stage.startswith(("setup", "call")) else None


def split_group(test_id: str) -> tuple[str, str]:
    """``test_id`` without the ``@<group>`` that pytest-xdist's ``--dist loadgroup`` appends to the
    id of a test marked ``xdist_group`` (the id pytest selects the test by), and that group ("" where
    there is none; an "@" within the parameters' brackets is the parameters')."""
    if test_id.rfind("@") > test_id.rfind("]"):
        test, _, group = test_id.rpartition("@")
        return test, group
    return test_id, ""


def record_from_environment() -> bool:
    """Record every use of a resolved precision where `USES` names a folder (True), else nothing."""
    folder = os.environ.get(USES)
    if not folder:
        return False
    from hydra_ensembles.precision import Precision

    if getattr(Precision, "_uses_recorded", False):
        return True
    seen: set[str] = set()
    log = Path(folder) / f"uses-{os.getpid()}.txt"

    def note(precision) -> None:
        test = _test_id(precision)
        if test and test not in seen:
            seen.add(test)
            with open(log, "a", encoding="utf-8") as out:
                out.write(test + "\n")

    def recording(name: str):
        original = getattr(Precision, name)
        if isinstance(original, property):
            return property(lambda self: (note(self), original.fget(self))[1])
        return lambda self, *args, **kwargs: (note(self), original(self, *args, **kwargs))[1]

    for name in ("autocast", "reduced", "dtype"):
        setattr(Precision, name, recording(name))
    # resolving counts as a use: the command line resolves ``auto`` once and passes on the name
    created = Precision.__init__
    Precision.__init__ = lambda self, *args, **kwargs: (created(self, *args, **kwargs), note(self))[0]
    Precision._uses_recorded = True
    return True


SELECTED = "HYDRA_PRECISION_RERUN"
"""A file of recorded test ids, one a line: where set, a pytest run runs those tests only, in
pytest's own order (scripts/test.sh's reruns; `select_recorded`)."""


def select_recorded(items: list, deselect: Callable[[list], object]) -> None:
    """Keep in ``items`` (pytest's collected tests, in its order) the tests `SELECTED`'s file names,
    calling ``deselect`` with the others; where that variable is unset, keep every test. The
    tests keep the order of any pytest run, a module's tests together (its shared fixtures built
    once), not the order they were recorded in; a named test that was not collected is an error
    (the record would otherwise lose it without a word)."""
    listed = os.environ.get(SELECTED)
    if not listed:
        return
    wanted = set(Path(listed).read_text(encoding="utf-8").split("\n")) - {""}
    ids = [split_group(item.nodeid)[0] for item in items]
    missing = wanted.difference(ids)
    if missing:
        named = ", ".join(sorted(missing)[:3])
        raise LookupError(f"{len(missing)} recorded test(s) not collected (give their files): {named}")
    deselect([item for item, test in zip(items, ids, strict=True) if test not in wanted])
    items[:] = [item for item, test in zip(items, ids, strict=True) if test in wanted]


def recorded(folder: str | os.PathLike) -> list[str]:
    """The ids of the tests that used a resolved precision, in the order first seen."""
    found: dict[str, None] = {}
    for log in sorted(Path(folder).glob("uses-*.txt")):
        found.update(dict.fromkeys(log.read_text(encoding="utf-8").splitlines()))
    return [test for test in found if test]


if __name__ == "__main__":  # python -m tests.precision_use FOLDER: the ids, one a line
    import sys

    print("\n".join(recorded(sys.argv[1])))
