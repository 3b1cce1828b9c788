#!/usr/bin/env bash
# Set up .venv (Python 3.11, what CI tests) for one of three jobs from its lock; idempotent (a second run only checks).
#
#   bash scripts/setup.sh          the main job: locks/main.txt (CPU torch 2.13.0, diffusers 0.42.1, [train])
#   bash scripts/setup.sh verl     the verl examples: locks/verl.txt (the above + verl 0.9.1)
#   bash scripts/setup.sh test     the tests: locks/test.txt (the above + [dev]) and the diffusers compatibility
#                                  matrix (each release in .dmatrix/<version>, used through PYTHONPATH)
#
# Nothing is resolved here: uv (the version the lock pins, bootstrapped by pip) syncs the venv to the lock's exact
# versions (adding what is missing, removing what the lock does not name) and compiles their bytecode (where
# PYTHONDONTWRITEBYTECODE is set, as on CI, nothing else would, and every process would recompile torch, diffusers and
# transformers at import: seconds each, the suite twice as slow), installs sp-diffusers itself (editable,
# no build isolation: setuptools comes from the lock), then setup imports what the profile uses and runs `pip check`;
# a failure is one line naming the broken package. A profile includes the ones before it (main < verl < test), at
# the same versions. scripts/lock.sh regenerates the locks; docs/compatibility.md says why uv.
# One progress line per step; pip's own output goes to .venv/setup.log (shown when a step fails).
# SP_PYTHON chooses the interpreter, SP_VENV the environment, SP_DIFFUSERS_MATRIX(_DIR) the matrix.
#
# GPU machines: SP_TORCH=system keeps the torch that SP_PYTHON already has (a CUDA build): the environment
# sees its site-packages (--system-site-packages) and the lock's torch line is left out, so nothing replaces it
# with the CPU build. The GPU examples run `SP_TORCH=system SP_VENV=.venv-gpu bash scripts/setup.sh`.
# Elsewhere without the CPU torch wheel at hand: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=${1:-main}
case "$PROFILE" in main) RANK=1 ;; verl) RANK=2 ;; test) RANK=3 ;;
  *) echo "usage: bash scripts/setup.sh [main|verl|test]" >&2; exit 2 ;; esac
PY=${SP_PYTHON:-python3}
VENV=${SP_VENV:-.venv}
MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-.dmatrix}
MATRIX_VERSIONS=${SP_DIFFUSERS_MATRIX:-"0.36.0 0.37.1 0.38.0 0.39.0 0.40.0 0.41.0 0.42.1"}
LOCK=locks/$PROFILE.txt
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
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)  # only to bootstrap uv
if [ "$TORCH_SOURCE" = system ] &&
  ! "$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(); print(torch.__version__)' >>"$LOG" 2>&1; then
  echo "[setup] SP_TORCH=system needs a torch with CUDA in $PY's site-packages, and a visible GPU (see $LOG)" >&2
  exit 1
fi

# uv installs the locks: the version test.txt pins, bootstrapped by pip (one wheel, no dependencies).
UV_PIN=$(grep -E '^uv==' locks/test.txt | cut -d' ' -f1)
if [ "$("$VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "${UV_PIN#uv==}" ]; then
  step "$UV_PIN (the installer)" "${PIP[@]}" install -q --no-deps "$UV_PIN"
fi
UV=("$VENV/bin/uv" pip)
mapfile -t SOURCES < <("$VENV/bin/python" scripts/pip_sources.py)  # uv does not read pip's configuration
TARGET=(--python "$VENV/bin/python" --index-strategy unsafe-best-match "${SOURCES[@]}")

# The stamp: which profile is installed, from which locks and scripts. A larger profile serves a smaller one.
STAMP="$VENV/.sp-diffusers-env"
want="$(cat locks/*.txt pyproject.toml scripts/setup.sh scripts/check_env.py scripts/pip_sources.py |
  sha1sum | cut -c1-12)-$TORCH_SOURCE"
have_rank=0 have_hash=
[ -f "$STAMP" ] && read -r have_rank have_hash <"$STAMP"
if [ "$have_hash" != "$want" ] || [ "$have_rank" -lt "$RANK" ]; then
  rm -f "$STAMP"
  pinned="$VENV/pinned.txt"  # the lock as installed (without torch where the system's is kept)
  if [ "$TORCH_SOURCE" = system ]; then grep -v '^torch==' "$LOCK" >"$pinned"; else cp "$LOCK" "$pinned"; fi
  # sync: exactly the lock's packages at its versions, whatever the venv held before (no resolve)
  step "$(grep -c '^[a-z0-9].*==' "$pinned") packages from $LOCK ($(grep -E '^(torch|diffusers|transformers)==' \
    "$pinned" | cut -d' ' -f1 | tr '\n' ' ' | sed 's/ $//'))" "${UV[@]}" sync --compile-bytecode "${TARGET[@]}" "$pinned"
  step "sp-diffusers (editable)" "${UV[@]}" install --no-deps --no-build-isolation "${TARGET[@]}" -e .
  printf '[setup] smoke import of the %s profile and pip check ... ' "$PROFILE"
  start=$SECONDS
  if ! broken=$("$VENV/bin/python" scripts/check_env.py smoke "$PROFILE" 2>>"$LOG"); then
    echo "FAILED"
    echo "[setup] $broken (docs/troubleshooting.md, 'The environment')" >&2
    exit 1
  fi
  echo "done ($((SECONDS - start)) s)"
  echo "$RANK $want" >"$STAMP"
fi

if [ "$PROFILE" = test ]; then
  mkdir -p "$MATRIX_DIR"
  missing=()
  for v in $MATRIX_VERSIONS; do
    [ -d "$MATRIX_DIR/$v/diffusers" ] || missing+=("$v")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    install_matrix() {  # diffusers is pure Python: each release on its own, without its dependencies
      local pids=() v
      for v in "${missing[@]}"; do
        "${UV[@]}" install -q --no-deps --compile-bytecode --target "$MATRIX_DIR/$v" "${TARGET[@]}" "diffusers==$v" &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p"; done
    }
    step "diffusers matrix ${missing[*]} -> $MATRIX_DIR/" install_matrix
  fi
fi
echo "[setup] ready ($PROFILE): $("$VENV/bin/python" -c 'import torch, diffusers; print("torch", torch.__version__, "| diffusers", diffusers.__version__)')"
