#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with everything the main job and the tests
# need. torch is installed first on its own, pinned, so pip takes the CPU wheel and no CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "[setup] installing torch==2.13.0 (CPU)"
.venv/bin/python -m pip install -q torch==2.13.0
echo "[setup] installing the project and its extras"
.venv/bin/python -m pip install -q -e ".[bundled,serving,bench,dev]"
