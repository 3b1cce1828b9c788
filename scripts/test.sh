#!/usr/bin/env bash
# The test command: set up (if needed), lint, then the whole suite on CPU with real gloo processes.
#   bash scripts/test.sh [pytest args]     the whole suite (what CI runs)
#   bash scripts/test.sh --quick [args]    the inner loop (about 2 minutes): attention ops, the world-8 canary,
#                                          kernels, masks and padding, the FlowGRPO math, layout, the README
#                                          snippet and one exact engine step at SP 2 - the installed diffusers only
# Test files run on SP_TEST_WORKERS pytest workers (default 2, pytest-xdist; 0: one process), a file per worker:
# its process groups and cached runs stay together. Ranks spend much of a test starting up and waiting on
# each other, so two files at once use two cores better than one does.
set -euo pipefail
QUICK=(
  tests/test_attention_ops.py tests/test_canary.py tests/test_kernels.py tests/test_padding.py tests/test_devices.py
  tests/test_flowgrpo_algorithms.py tests/test_flowgrpo_math.py tests/test_config_keys.py tests/test_layout.py
  tests/test_plans.py tests/test_readme.py
  "tests/test_engine.py::test_flowgrpo_step_matches_one_process[sp2-full-qwenimage]"
)
if [ "${1:-}" = "--quick" ]; then
  shift
  set -- "${QUICK[@]}" "$@"
fi
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export SP_DIFFUSERS_MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-$PWD/.dmatrix}
.venv/bin/ruff check .
WORKERS=(-n "${SP_TEST_WORKERS:-2}" --dist loadfile)
[ "${SP_TEST_WORKERS:-2}" = 0 ] && WORKERS=()
.venv/bin/python -m pytest ${WORKERS[@]+"${WORKERS[@]}"} "$@"
