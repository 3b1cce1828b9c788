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
#
# GPU machines: SP_TORCH=system keeps the torch that SP_PYTHON already has (a CUDA build): the environment
# sees its site-packages (--system-site-packages) and every resolve pins that exact torch, so nothing
# replaces it with the CPU build. The GPU examples run `SP_TORCH=system SP_VENV=.venv-gpu bash scripts/setup.sh`.
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

TORCH_SOURCE=${SP_TORCH:-cpu}
case "$TORCH_SOURCE" in cpu | system) ;; *) echo "SP_TORCH=$TORCH_SOURCE: choose cpu (default) or system" >&2; exit 2 ;; esac
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  if [ "$TORCH_SOURCE" = system ]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
: >"$LOG"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)-$TORCH_SOURCE"
TORCH="torch==2.13.0"
TORCH_LABEL="torch 2.13.0 (CPU build)"
if [ "$TORCH_SOURCE" = system ]; then
  if ! TORCH_VERSION=$("$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(); print(torch.__version__)' 2>>"$LOG"); then
    echo "[setup] SP_TORCH=system needs a torch with CUDA in $PY's site-packages, and a visible GPU (see $LOG)" >&2
    exit 1
  fi
  TORCH="torch==$TORCH_VERSION"
  TORCH_LABEL="the system's torch $TORCH_VERSION (kept)"
fi

# torch is pinned in every resolve so nothing can pull a multi-GB CUDA build instead.
if [ "$(cat "$VENV/.sp-diffusers-main" 2>/dev/null)" != "$want" ]; then
  step "pip itself" "${PIP[@]}" --upgrade pip
  step "$TORCH_LABEL, diffusers 0.42.1, sp-diffusers[train]" \
    "${PIP[@]}" "$TORCH" "diffusers==0.42.1" -e ".[train]"
  echo "$want" >"$VENV/.sp-diffusers-main"
fi

if [ "$PROFILE" != main ] && [ "$(cat "$VENV/.sp-diffusers-verl" 2>/dev/null)" != "$want" ]; then
  # verl without its extras (they pin another torch); it pins transformers<5.11 and tensordict<=0.10
  step "verl 0.9.1" "${PIP[@]}" "$TORCH" "diffusers==0.42.1" "verl==0.9.1" -e ".[train]"
  echo "$want" >"$VENV/.sp-diffusers-verl"
fi

if [ "$PROFILE" = test ]; then
  if [ "$(cat "$VENV/.sp-diffusers-test" 2>/dev/null)" != "$want" ]; then
    step "the test tools (sp-diffusers[dev])" \
      "${PIP[@]}" "$TORCH" "diffusers==0.42.1" "verl==0.9.1" -e ".[dev]"
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
