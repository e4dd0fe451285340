#!/usr/bin/env bash
# Sets up and runs the whole test suite (the bundled model is converted once and cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
