#!/usr/bin/env bash
# Create .venv (Python >= 3.10) with CPU torch 2.13.0, sp-diffusers (editable) and its dev/train extras,
# and the diffusers compatibility matrix (each release in its own --target folder, used via PYTHONPATH).
# Idempotent: a second run only checks. Set SP_PYTHON to choose the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${SP_PYTHON:-python3}
VENV=${SP_VENV:-.venv}
MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-.dmatrix}
MATRIX_VERSIONS=${SP_DIFFUSERS_MATRIX:-"0.36.0 0.37.1 0.38.0 0.39.0 0.40.0 0.41.0 0.42.1"}
STAMP="$VENV/.sp-diffusers-setup"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
want="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing torch==2.13.0 (CPU build), verl==0.9.1 and sp-diffusers[dev]"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch is pinned in the same resolve so nothing can pull a multi-GB CUDA build instead; verl without its
  # extras (they pin another torch). verl pins transformers<5.11 and tensordict<=0.10, both fine here.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" "diffusers==0.42.1" "verl==0.9.1" -e ".[dev]"
  echo "$want" > "$STAMP"
fi

mkdir -p "$MATRIX_DIR"
pids=()
for v in $MATRIX_VERSIONS; do
  if [ ! -d "$MATRIX_DIR/$v/diffusers" ]; then
    echo "[setup] diffusers $v -> $MATRIX_DIR/$v"
    "$VENV/bin/python" -m pip install -q --no-deps --target "$MATRIX_DIR/$v" "diffusers==$v" &
    pids+=($!)
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
echo "[setup] ready: $("$VENV/bin/python" -c 'import torch, diffusers; print("torch", torch.__version__, "| diffusers", diffusers.__version__)')"
