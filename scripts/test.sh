#!/usr/bin/env bash
# The test command: set up (if needed), lint, then the whole suite on CPU with real gloo processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export SP_DIFFUSERS_MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-$PWD/.dmatrix}
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
