#!/usr/bin/env bash
# Sets up, prepares the bundled SmolLM2-135M-Instruct checkpoint (once), and starts the serving
# system on loopback: router (OpenAI HTTP API on :8000, gRPC on :50051) + 1 prefill worker + 1
# decode worker, each pinned to its own CPU when the machine has two or more. Arguments go to
# nxdi-serve: with --check "prompt" it answers one chat request and stops; without, it serves
# until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cpus=()
if [ "$(nproc)" -ge 2 ]; then cpus=(--threads 1 --cpus prefill0=0 --cpus decode0=1); fi
exec .venv/bin/nxdi-serve "${cpus[@]}" "$@"
