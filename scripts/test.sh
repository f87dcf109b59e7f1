#!/usr/bin/env bash
# Tests: set up the environment, lint, run the test suite in fp32 (slow tests excluded; `-m slow`
# runs them), then run again in bf16 and in fp16 every test that computed in the precision `auto`
# resolved during the fp32 pass, in its call or its fixtures' set-up (recorded by
# tests/precision_use.py: prediction, training, scoring, serving), except tests of pretrained
# checkpoints, tests that name their precision and so ran in the fp32 pass already, the tests
# that compare one process with two, and tests marked same_in_every_precision. The two reruns run
# side by side, every such test on both pytest-xdist workers, one in bf16, the other in fp16. The
# fp32 pass runs on every core (one worker per core, each with its share of the threads).
# Arguments go to one fp32 run in one process only, and skip the reruns.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_data.sh
export HF_HUB_OFFLINE=1
# bytecode is written where Python keeps it (.venv, and the checkout's __pycache__, which git
# ignores) even where PYTHONDONTWRITEBYTECODE is set: the set-up installs without compiling, and
# every process would otherwise compile again each module it imports
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
uses=$(mktemp -d)
trap 'rm -rf "$uses"' EXIT
HYDRA_PRECISION_USES="$uses" .venv/bin/python -m pytest -q -n auto --dist loadgroup
# the recorded tests, run in pytest's own order (tests/precision_use.py's select_recorded: a
# module's tests together, its shared fixtures built once) from the files that hold them
.venv/bin/python -m tests.precision_use "$uses" > "$uses/rerun.txt"  # not uses-*.txt: not a record
mapfile -t PRECISION_FILES < <(cut -d: -f1 "$uses/rerun.txt" | sort -u)  # the files that hold them
count=$(grep -c "" "$uses/rerun.txt")
if [ "$count" -lt 100 ]; then
    echo "only $count tests computed in the precision: tests/precision_use.py records no more" >&2
    exit 1
fi
echo "--- $count tests computed in the precision; those the rerun keeps (the header of scripts/test.sh says which) run again in bf16 and in fp16, one worker each"
HYDRA_PRECISION_RERUN="$uses/rerun.txt" HYDRA_WORKER_PRECISIONS=bf16,fp16 .venv/bin/python -m pytest -q -n 2 \
    --dist each -m "not slow and not real_model and not same_in_every_precision" \
    -k "not bf16 and not fp16 and not fp32 and not two_process" "${PRECISION_FILES[@]}"
