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
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"  # what is asked, and how
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # Installed without byte-compiling (pip's --no-compile; uv compiles nothing unless asked):
    # compiling every installed file, some 21,000, took a 2-core set-up from 21-25 s to 67 s and
    # saved less than that in the tests (docs/development.md), while the scripts that run the
    # package (test.sh, demo.sh) let Python write the bytecode of each module the first time it
    # is imported, which compiles only what is used.
    "$PY" -m pip install --quiet --no-compile --upgrade pip uv
    "$PY" -m pip install --quiet --no-compile "torch==2.13.0"
    # the rest by uv, which resolves and unpacks the test extras' 130-odd packages in a few
    # seconds where pip takes half a minute; torch stays the build pip installed (pinned here, a
    # package that would need another is taken at a release that does not). uv reads PyPI, not
    # pip's configuration: where it cannot install, pip does, with its own index settings.
    "$VENV/bin/uv" pip install --quiet --python "$PY" -e ".[test]" "torch==2.13.0" || {
        echo "setup_env: uv could not install the packages (above); pip installs them" >&2
        "$PY" -m pip install --quiet --no-compile -e ".[test]"
    }
    echo "$want" > "$stamp"
fi
