"""Shared fixtures: the real MiniLM-L6 and a tokenised batch for it."""

from __future__ import annotations

import os
import signal
import tempfile
import warnings

import pytest
import torch

from tests.precision_use import record_from_environment, select_recorded, split_group

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# scripts/test.sh's reruns run every selected test on every pytest-xdist worker (--dist each),
# each worker in its own precision: HYDRA_WORKER_PRECISIONS=bf16,fp16 gives gw0 bf16, gw1 fp16.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_per_worker = [p for p in os.environ.get("HYDRA_WORKER_PRECISIONS", "").split(",") if p]
_own_precision = _per_worker[int(_worker[2:])] if _per_worker and _worker.startswith("gw") else ""
if _own_precision:
    os.environ["HYDRA_PRECISION"] = _own_precision
# The suite computes in fp32 on every kind of CPU (AMX, AVX-512 BF16, AVX2-only alike), so its
# numbers and its time do not depend on the machine; tests of the precision decision unset this.
os.environ.setdefault("HYDRA_PRECISION", "fp32")
# Fine-tuning trains where Accelerate finds an accelerator and leaves the model there; the suite
# compares with computations on the CPU, so it trains on the CPU also where a GPU is present
# (tests/fusion/test_cuda.py holds the GPU checks).
os.environ.setdefault("ACCELERATE_USE_CPU", "true")
# Measurements of the machine (the cache inference chunks are sized to, the bf16 probe) are kept
# beside the suite's other temporary files, not in the user's home.
os.environ.setdefault(
    "HYDRA_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"hydra-ensembles-tests-{os.getuid()}")
)
# Under pytest-xdist each worker takes its share of the cores (one per worker on two cores).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))
# scripts/test.sh's fp32 pass records which tests compute in the precision, to rerun them in bf16
# and fp16 (tests/precision_use.py).
record_from_environment()
# A background job of a non-interactive shell starts with SIGINT ignored, and so would every
# child process the tests start: give the suite Python's usual Ctrl-C handling.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header(config):
    if _per_worker:
        return f"each worker in its own precision: {', '.join(_per_worker)} (gw0, gw1, ...)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure of a rerun names the precision it ran in."""
    outcome = yield
    if _own_precision:
        outcome.get_result().sections.append(("precision", f"ran in {_own_precision}"))


_UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: the marks added here count there
def pytest_collection_modifyitems(config, items):
    """Tests that use the real MiniLM-L6 are marked ``real_model``. Where scripts/test.sh's reruns
    name the recorded tests (`tests.precision_use.SELECTED`), only those are kept."""
    for item in items:
        if "minilm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
    select_recorded(items, lambda gone: config.hook.pytest_deselected(items=gone))


def pytest_collection_finish(session):
    """Under ``--dist loadgroup``, a test marked ``xdist_group`` whose id lacks its group fails:
    pytest-xdist groups tests by that suffix only (appended to the ids as it collects), and
    without it would spread the group's tests over the workers silently, each building the
    group's shared fixtures (an exported graph, a Ray instance) again."""
    if _worker and session.config.getoption("loadgroup", False):  # set on the workers by pytest-xdist
        for item in session.items:
            if item.get_closest_marker("xdist_group") and not split_group(item.nodeid)[1]:
                item.stash[_UNGROUPED] = (
                    f"pytest-xdist cannot group this test under pytest {pytest.__version__} (its id "
                    "lacks the group): install the pytest pyproject.toml asks for (bash scripts/setup_env.sh)"
                )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test whose group pytest-xdist lost fails before its fixtures are built."""
    if _UNGROUPED in item.stash:
        pytest.fail(item.stash[_UNGROUPED], pytrace=False)


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 with a seeded 4-way classifier head."""
    from hydra_ensembles.models import load_classifier

    torch.manual_seed(0)
    return load_classifier(num_labels=4).eval()


@pytest.fixture(scope="session")
def minilm_inputs():
    from hydra_ensembles.models import load_tokenizer

    texts = [
        "The central bank raised interest rates again on Thursday.",
        "A late goal sealed the championship for the home side.",
        "Parliament votes on the new budget next week.",
        "The new phone ships with a faster chip and a better camera.",
    ]
    return dict(load_tokenizer()(texts, padding=True, truncation=True, max_length=32, return_tensors="pt"))


@pytest.fixture(autouse=True)
def _sigint_handling_restored(request):
    """A test (or a library it calls) that leaves SIGINT ignored would make every later child
    process ignore Ctrl-C too: restore Python's handler and say which test did it."""
    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"{request.node.nodeid} left SIGINT changed; restored", stacklevel=1)
