#!/usr/bin/env bash
# The compatibility matrix of docs/compatibility.md ("Python, torch and transformers"): each combination in
# its own fresh venv, one after the other, then the venv is deleted. Not part of CI: PyPI's torch for Linux
# x86_64 is a CUDA build of several GB per combination (on a machine without a GPU driver that is one of
# the cases tested: a CUDA build where no GPU can be used).
#
#   bash scripts/compat_matrix.sh                        the rows of docs/compatibility.md
#   bash scripts/compat_matrix.sh 3.12/2.15.0/5.24.0/0.42.1 [3.11/2.7.1/5.0.0/0.36.0/wheel ...]
#
# A row is PYTHON/TORCH/TRANSFORMERS/DIFFUSERS[/wheel] (TRANSFORMERS, DIFFUSERS: a version, or "latest": the newest
# release, resolved today; CI installs the locks instead, so this is how a new release is tried): the diffusers pip installs (the others of the
# diffusers matrix come from SP_DIFFUSERS_MATRIX_DIR, as in CI); "wheel" installs a wheel built from this
# checkout instead of an editable install, and runs the main job from another directory. Checks per row:
#   install   pip resolves the row with sp-diffusers[train] (the pins exactly as given)
#   parity    SP = 2 against one process: the README snippet, the attention ops, every model on the row's
#             diffusers (tests/test_readme.py, test_attention_ops.py, test_model_parity.py)
#   patches   every patch on diffusers 0.36.0, 0.37.1 and 0.42.1 (each patch is applied on one of them and
#             skipped on another; CI runs all seven), install()/uninstall() (test_patches.py, test_install.py)
#   engine    the engine's FlowGRPO step at SP = 2 and at dp 2 x SP 2 against one process (test_engine.py,
#             test_flowgrpo_step_matches_one_process -k sp2: Qwen-Image full and LoRA at both, SD3 and Wan from
#             pipeline folders with their own text encoders; torch 2.7.1 fails dp 2 x SP 2)
#   main      the main job (examples/configs/tiny_qwenimage_sp2.yaml) for 3 iterations on 2 processes
# Results: one markdown row per combination appended to $SP_COMPAT_DIR/results.md; logs in
# $SP_COMPAT_DIR/logs/. SP_PYTHON_3_12=/path/to/python3.12 (etc.) picks an interpreter, else python3.12 on
# PATH, else pyenv's newest 3.12.*. SP_COMPAT_KEEP=1 keeps the venvs. pip's own configuration applies (a
# constraint file that caps torch makes a newer torch's install fail: the row says so).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${SP_COMPAT_DIR:-$ROOT/.compat}
MATRIX_DIR=${SP_DIFFUSERS_MATRIX_DIR:-$ROOT/.dmatrix}
MATRIX_VERSIONS="0.36.0 0.37.1 0.38.0 0.39.0 0.40.0 0.41.0 0.42.1"
# python/torch/transformers/diffusers[/wheel]: the floor, each Python, the pinned CPU default, the newest
DEFAULT_ROWS=(
  3.11/2.6.0/5.0.0/0.36.0
  3.11/2.7.1/5.0.0/0.36.0
  3.11/2.8.0/5.0.0/0.42.1
  3.11/2.9.1/5.0.0/0.42.1
  3.11/2.10.0/5.0.0/0.42.1
  3.12/2.11.0/5.17.0/0.42.1
  3.11/2.12.1/5.24.0/0.42.1
  3.11/2.13.0/5.24.0/0.42.1/wheel
  3.11/2.14.1/5.24.0/0.42.1
  3.11/2.15.0/5.24.0/0.42.1
  3.12/2.15.0/5.24.0/0.42.1
  3.13/2.15.0/5.24.0/0.42.1
  3.11/2.13.0/latest/latest
)
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=("${DEFAULT_ROWS[@]}")
mkdir -p "$DIR/logs"
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}  # a CUDA torch is GBs: no second copy in pip's cache
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1 SP_DIFFUSERS_MATRIX_DIR=$MATRIX_DIR

python_for() {  # python_for 3.12 -> an interpreter of that version that runs, or nothing
  local var="SP_PYTHON_${1//./_}" candidate
  for candidate in ${!var:-} "$(command -v "python$1" || true)" \
    $(command -v pyenv >/dev/null && ls -d "$(pyenv root)"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -rV); do
    # a pyenv shim exists for every installed version but runs only the selected ones
    if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version.startswith('$1.')" 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}

# the diffusers matrix (pure Python, shared by every row): what CI installs with scripts/setup.sh
for v in $MATRIX_VERSIONS; do
  if [ ! -d "$MATRIX_DIR/$v/diffusers" ]; then
    echo "[matrix] diffusers $v -> $MATRIX_DIR/$v"
    python3 -m pip install -q --no-deps --target "$MATRIX_DIR/$v" "diffusers==$v"
  fi
done

[ -f "$DIR/results.md" ] || {
  echo "| date | Python | torch | transformers | diffusers | install | parity SP=2 | patches | engine step | main job (3 it.) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
} >"$DIR/results.md"

run_check() {  # run_check NAME FUNCTION: "pass (Ns)" or "FAIL (Ns)"; the log's tail on failure
  local name=$1 log="$logs/$1.log" start=$SECONDS
  printf '[matrix]   %-8s ... ' "$name" >&2
  if timeout 5400 nice -n 10 bash -c "$2" >"$log" 2>&1; then
    echo "done ($((SECONDS - start)) s)" >&2
    echo "pass ($((SECONDS - start)) s)"
  else
    echo "FAILED ($((SECONDS - start)) s): $log" >&2
    tail -n 15 "$log" | sed 's/^/[matrix]     /' >&2
    echo "FAIL ($((SECONDS - start)) s)"
  fi
}

# The steps, run by run_check in a child bash (hence exported, with the variables they read).
step_install() {
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_v"  # alone first: nothing else may choose the build
  local package=(-e "$ROOT[train]")
  if [ "$mode" = wheel ]; then
    rm -rf "$DIR/dist"
    "$venv/bin/python" -m pip wheel -q --no-deps -w "$DIR/dist" "$ROOT"
    package=("$(ls "$DIR"/dist/sp_diffusers-*.whl)[train]")
  fi
  local pins=("torch==$torch_v")  # "latest": whatever the index has newest today (a report, never CI's gate)
  [ "$tf_v" = latest ] && pins+=(transformers) || pins+=("transformers==$tf_v")
  [ "$diff_v" = latest ] && pins+=(diffusers) || pins+=("diffusers==$diff_v")
  "$venv/bin/python" -m pip install -q --upgrade "${pins[@]}" "${package[@]}" pytest pytest-timeout "setuptools>=77"
  "$venv/bin/python" -m pip list 2>/dev/null |
    grep -i -E "^(torch|transformers|diffusers|peft|accelerate|huggingface.hub|numpy|sp.diffusers) "
}
step_pytest() { "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"; }
step_parity() {
  step_pytest tests/test_readme.py tests/test_attention_ops.py tests/test_model_parity.py \
    -k "test_readme or test_attention_parity or $("$venv/bin/python" -c 'import diffusers; print(diffusers.__version__)')-P2"
}
step_patches() {  # 0.36/0.37/0.42: where each patch is applied at least once, and skipped too (CI runs all 7)
  step_pytest tests/test_patches.py tests/test_install.py -k "not test_probe_defect_and_fix and \
    not test_apply_revert_idempotent_and_uninstall or 0.36.0 or 0.37.1 or 0.42.1"
}
step_engine() {  # every SP 2 and dp 2 x SP 2 case: Qwen-Image full and LoRA, SD3 and Wan from pipeline folders
  step_pytest tests/test_engine.py::test_flowgrpo_step_matches_one_process -k sp2
}
step_main() {  # with a wheel from another directory: the installed package, not this checkout
  local out="$DIR/runs/$name" cwd=$ROOT
  rm -rf "$out"
  [ "$mode" = wheel ] && cwd=$DIR
  cd "$cwd"
  "$venv/bin/python" -c 'import sp_diffusers; print("sp_diffusers from", sp_diffusers.__file__)'
  "$venv/bin/torchrun" --standalone --nproc_per_node 2 -m sp_diffusers.cli train \
    --config "$ROOT/examples/configs/tiny_qwenimage_sp2.yaml" --iterations 3 --out-dir "$out"
  [ "$(wc -l <"$out/metrics.jsonl")" -eq 3 ]
}
export -f step_install step_pytest step_parity step_patches step_engine step_main
export ROOT DIR

for row in "${ROWS[@]}"; do
  IFS=/ read -r py torch_v tf_v diff_v mode <<<"$row"
  mode=${mode:-}
  name="py${py}-torch${torch_v}-tf${tf_v}-d${diff_v}${mode:+-$mode}"
  logs="$DIR/logs/$name"
  venv="$DIR/venvs/$name"
  export py torch_v tf_v diff_v mode name venv
  mkdir -p "$logs"
  echo "[matrix] $row"
  interpreter=$(python_for "$py")
  if [ -z "$interpreter" ]; then
    echo "| $(date +%F) | $py | $torch_v | $tf_v | $diff_v | no Python $py here | - | - | - | - |" >>"$DIR/results.md"
    continue
  fi
  rm -rf "$venv"
  "$interpreter" -m venv "$venv"
  r_install=$(run_check install "set -e; step_install")
  r_parity=- r_patches=- r_engine=- r_main=- torch_desc=$torch_v
  if [[ $r_install == pass* ]]; then
    torch_desc=$("$venv/bin/python" -c 'import torch
cuda = torch.version.cuda
print(torch.__version__ + (f" (CUDA {cuda} build, {torch.cuda.device_count()} GPUs)" if cuda else " (CPU build)"))')
    r_parity=$(run_check parity step_parity)
    r_patches=$(run_check patches step_patches)
    r_engine=$(run_check engine step_engine)
    r_main=$(run_check main "set -e; step_main")
  fi
  python_v=$("$venv/bin/python" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo "$py")
  version_of() { "$venv/bin/python" -c "import $1; print($1.__version__)" 2>/dev/null; }
  if [ "$tf_v" = latest ]; then tf_v="latest ($(version_of transformers))"; fi  # what a "latest" row resolved
  if [ "$diff_v" = latest ]; then diff_v="latest ($(version_of diffusers))"; fi
  echo "| $(date +%F) | $python_v | $torch_desc | $tf_v | $diff_v${mode:+ ($mode)} | $r_install | $r_parity |" \
    "$r_patches | $r_engine | $r_main |" >>"$DIR/results.md"
  tail -n 1 "$DIR/results.md"
  [ "${SP_COMPAT_KEEP:-0}" = 1 ] || rm -rf "$venv"
done
echo "[matrix] results: $DIR/results.md"
