#!/usr/bin/env bash
# Main job: set up the environment, then run the end-to-end demo on the embedded default (MiniLM-L6).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_data.sh
export HF_HUB_OFFLINE=1
# bytecode is written where Python keeps it (.venv, and the checkout's __pycache__, which git
# ignores) even where PYTHONDONTWRITEBYTECODE is set: the set-up installs without compiling, and
# every process would otherwise compile again each module it imports
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/hydra-ens demo "$@"
