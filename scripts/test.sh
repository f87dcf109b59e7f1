#!/usr/bin/env bash
# Tests: set up the environment, lint, run the test suite in fp32 (slow tests excluded; `-m slow`
# runs them), then run the tests of every path that depends on the precision again in bf16 and
# in fp16 (tiny models; tests of pretrained checkpoints, and tests that name their precision and
# so ran in the fp32 pass already, and the tests that compare one process with two, are skipped
# there). The tests run on every core (pytest-xdist, one worker per core, each with its share of
# the threads). Arguments go to one fp32 run in one process only, and skip the reruns.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_data.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q -n auto
PRECISION_PATHS=(
    tests/members tests/baselines tests/test_training.py tests/scoring tests/zero_shot tests/fusion
    tests/layers tests/evaluation tests/test_low_precision.py tests/cli/test_pipeline.py
    tests/cli/test_zero_shot.py tests/cli/test_sweep.py tests/experiments/test_prediction_cache.py
    tests/experiments/test_demos_tiny.py
)
for precision in bf16 fp16; do
    echo "--- the precision-dependent tests in $precision"
    HYDRA_PRECISION=$precision .venv/bin/python -m pytest -q -n auto -m "not slow and not real_model" \
        -k "not bf16 and not fp16 and not fp32 and not two_process" "${PRECISION_PATHS[@]}"
done
