#!/usr/bin/env bash
# GPU check of pinned-memory staging: stall and commit with CUDA tensors (under 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup
exec .venv/bin/python bench/gpu_check.py "$@"
