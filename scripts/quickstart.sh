#!/usr/bin/env bash
# Sets up, prepares the bundled SmolLM2-135M-Instruct checkpoint (once), and generates text for a
# prompt through nxdi_common (compiled per bucket on CPU; compiled artifacts are cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/nxdi-generate "$@"
