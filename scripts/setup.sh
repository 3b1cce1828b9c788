#!/usr/bin/env bash
# Set up .venv (Python 3.11, what CI tests) for one of two jobs; idempotent (a second run only checks).
#
#   bash scripts/setup.sh          the main job: CPU torch 2.13.0 + sp-diffusers (editable) with [train]
#   bash scripts/setup.sh verl     the verl examples: the above + verl 0.9.1
#   bash scripts/setup.sh test     the tests: the above + [dev] and the diffusers compatibility matrix
#                                  (each release in .dmatrix/<version>, used through PYTHONPATH)
#
# One progress line per step; pip's own output goes to .venv/setup.log (shown when a step fails).
# SP_PYTHON chooses the interpreter, SP_VENV the environment, SP_DIFFUSERS_MATRIX(_DIR) the matrix.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${1:-main}
case "$PROFILE" in main | verl | test) ;; *) echo "usage: bash scripts/setup.sh [main|verl|test]" >&2; exit 2 ;; esac
PY=${SP_PYTHON:-python3}
VENV=${SP_VENV:-.venv}
MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-.dmatrix}
MATRIX_VERSIONS=${SP_DIFFUSERS_MATRIX:-"0.36.0 0.37.1 0.38.0 0.39.0 0.40.0 0.41.0 0.42.1"}
LOG="$VENV/setup.log"

step() {  # step "what" command...: one line, the seconds it took; the log's tail on failure
  local what=$1 start=$SECONDS
  shift
  printf '[setup] %s ... ' "$what"
  if "$@" >>"$LOG" 2>&1; then
    echo "done ($((SECONDS - start)) s)"
  else
    echo "FAILED"
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
: >"$LOG"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"

# torch is pinned in every resolve so nothing can pull a multi-GB CUDA build instead.
if [ "$(cat "$VENV/.sp-diffusers-main" 2>/dev/null)" != "$want" ]; then
  step "pip itself" "${PIP[@]}" --upgrade pip
  step "torch 2.13.0 (CPU build), diffusers 0.42.1, sp-diffusers[train]" \
    "${PIP[@]}" "torch==2.13.0" "diffusers==0.42.1" -e ".[train]"
  echo "$want" >"$VENV/.sp-diffusers-main"
fi

if [ "$PROFILE" != main ] && [ "$(cat "$VENV/.sp-diffusers-verl" 2>/dev/null)" != "$want" ]; then
  # verl without its extras (they pin another torch); it pins transformers<5.11 and tensordict<=0.10
  step "verl 0.9.1" "${PIP[@]}" "torch==2.13.0" "diffusers==0.42.1" "verl==0.9.1" -e ".[train]"
  echo "$want" >"$VENV/.sp-diffusers-verl"
fi

if [ "$PROFILE" = test ]; then
  if [ "$(cat "$VENV/.sp-diffusers-test" 2>/dev/null)" != "$want" ]; then
    step "the test tools (sp-diffusers[dev])" \
      "${PIP[@]}" "torch==2.13.0" "diffusers==0.42.1" "verl==0.9.1" -e ".[dev]"
    echo "$want" >"$VENV/.sp-diffusers-test"
  fi
  mkdir -p "$MATRIX_DIR"
  missing=()
  for v in $MATRIX_VERSIONS; do
    [ -d "$MATRIX_DIR/$v/diffusers" ] || missing+=("$v")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    install_matrix() {
      local pids=() v
      for v in "${missing[@]}"; do
        "${PIP[@]}" --no-deps --target "$MATRIX_DIR/$v" "diffusers==$v" &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p"; done
    }
    step "diffusers matrix ${missing[*]} -> $MATRIX_DIR/" install_matrix
  fi
fi
echo "[setup] ready ($PROFILE): $("$VENV/bin/python" -c 'import torch, diffusers; print("torch", torch.__version__, "| diffusers", diffusers.__version__)')"
