#!/usr/bin/env bash
# Regenerate the locks (locks/*.txt) that scripts/setup.sh installs from: one `uv pip compile` resolve per profile.
#
#   bash scripts/lock.sh                        keep every pin that still satisfies the inputs (minimal change)
#   bash scripts/lock.sh --upgrade              every package to its newest release the inputs allow
#   bash scripts/lock.sh --upgrade-package X    X alone (repeatable), e.g. after a fix in transformers
#
# locks/test.txt is the whole environment (pyproject.toml's extras train, verl and dev, at the versions of
# locks/test.in); locks/verl.txt and locks/main.txt are compiled with test.txt as a constraint, so each profile is a
# subset of the next at the same versions. uv resolves from the sources pip's configuration names
# (scripts/pip_sources.py: the CPU build of torch lies in a local folder of wheels). After a new lock, run the tests
# (`bash scripts/test.sh`) before committing it; the newest releases beyond the lock are tried by
# scripts/compat_matrix.sh, which never gates CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SP_PYTHON:-python3}
TOOLS=.venv-lock
UV_PIN=$(grep -E '^uv==' locks/test.txt | cut -d' ' -f1)
if [ "$("$TOOLS/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "${UV_PIN#uv==}" ]; then
  echo "[lock] $UV_PIN -> $TOOLS"
  [ -x "$TOOLS/bin/python" ] || "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$UV_PIN"
fi
mapfile -t SOURCES < <("$TOOLS/bin/python" scripts/pip_sources.py)
compile() {  # compile PROFILE EXTRA...: locks/PROFILE.txt from pyproject.toml's extras and locks/PROFILE.in
  local profile=$1 extras=() e
  shift
  for e in "$@"; do extras+=(--extra "$e"); done
  echo "[lock] locks/$profile.txt (extras: $*)"
  "$TOOLS/bin/uv" pip compile --quiet --python "$TOOLS/bin/python" --index-strategy unsafe-best-match \
    --custom-compile-command "bash scripts/lock.sh" "${SOURCES[@]}" "${extras[@]}" ${LOCK_ARGS[@]+"${LOCK_ARGS[@]}"} \
    -o "locks/$profile.txt" pyproject.toml "locks/$profile.in"
}
LOCK_ARGS=("$@")
compile test train verl dev
LOCK_ARGS=()  # the subsets follow test.txt whatever was upgraded
compile verl train verl
compile main train
for profile in main verl test; do
  echo "[lock] locks/$profile.txt: $(grep -c '^[a-z0-9].*==' "locks/$profile.txt") packages"
done
