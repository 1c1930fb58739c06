#!/usr/bin/env bash
# GPU check: the stall and commit of pinned-memory staging with CUDA tensors (under 5
# minutes), then the CUDA tests (tests/ckpt/test_cuda.py and the deferred-staging one).
#
#   bash bench/gpu_check.sh [--gb 2] [--reps 3] [--out FILE]
#
# Where python3 (or $PYTHON) holds a CUDA build of torch, it runs there: a GPU machine's
# own interpreter, which may reach no package index. ckpt is then installed from this
# checkout alone (editable, no dependencies, no index: it needs torch, numpy, fsspec,
# xxhash, click, rich and prometheus-client, which such images hold). Elsewhere it uses
# the dev set-up (.ci/setup), whose CPU build of torch makes it stop at once (exit 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -c "import ckpt.store" 2>/dev/null || "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index -e .
else
  bash .ci/setup
  PY=.venv/bin/python
fi
"$PY" bench/gpu_check.py "$@"
"$PY" -m pytest -q -p no:cacheprovider tests/ckpt/test_cuda.py \
  tests/ckpt/test_deferred_staging.py::test_cuda_deferred_copy_reads_the_values_of_the_save_call
