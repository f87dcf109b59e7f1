#!/usr/bin/env bash
# Tests: set up the environment, lint, then run the test suite (slow tests excluded; `-m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_data.sh
export HF_HUB_OFFLINE=1
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
