#!/usr/bin/env bash
# The GPU acceptance check: one command for a machine with one or more NVIDIA GPUs and no network.
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--device cuda|cpu] [--only demo parity engine_step compile] [--json-out F]
#
# torch must be installed already (CUDA build). diffusers (and what it needs that the machine lacks, e.g.
# importlib_metadata), peft and transformers may come as wheels in DIR: they are installed, offline, into a
# temporary folder, never into the system. sp-diffusers itself runs from this tree (nothing is installed).
# Prints one JSON line per check (see scripts/gpu_check.py) and exits 1 when a check fails. Sized for a few
# minutes on one H200 (an estimate: it has not been run on a GPU yet); --device cpu is the dry mode (gloo,
# toy sizes) that CI runs.
# SP_PYTHON chooses the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SP_PYTHON:-python3}
WHEELS=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/site"
if [ -n "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$STAGE/site" "$WHEELS"/*.whl
fi
# sp_diffusers as it installs (its patches are sp_diffusers/patching/patches/ in the tree too)
cp -r sp_diffusers "$STAGE/site/sp_diffusers"
export PYTHONPATH="$STAGE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_check.py ${args[@]+"${args[@]}"}
