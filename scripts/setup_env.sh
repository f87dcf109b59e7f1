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
    # pip byte-compiles file by file on one core; compiling afterwards on every core is about
    # 20 s faster here (the bytecode is needed up front: PYTHONDONTWRITEBYTECODE may be set).
    "$PY" -m pip install --quiet --no-compile --upgrade pip
    "$PY" -m pip install --quiet --no-compile "torch==2.13.0"
    "$PY" -m pip install --quiet --no-compile -e ".[test]"
    # bytecode is only a speed-up, so a failure here never stops the set-up: some installed files
    # are not valid Python (templates, py2 test data) and fail to compile, as pip's own step
    # silently skips them
    "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
        > /dev/null || true
    echo "$want" > "$stamp"
fi
