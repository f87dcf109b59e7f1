#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install everything into it.
# Installs the local CPU build of torch first so no CUDA wheels are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HYDRA_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.hydra-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # Installed without byte-compiling (pip compiles every file, tens of thousands, on one core):
    # the scripts that run the package (test.sh, demo.sh) let Python write the bytecode of each
    # module the first time it is imported, which compiles only what is used, once.
    "$PY" -m pip install --quiet --no-compile --upgrade pip
    "$PY" -m pip install --quiet --no-compile "torch==2.13.0"
    "$PY" -m pip install --quiet --no-compile -e ".[test]"
    echo "$want" > "$stamp"
fi
