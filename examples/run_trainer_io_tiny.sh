#!/usr/bin/env bash
# The real-run path on 2 CPU processes at tiny size: pipeline folder -> FlowGRPO with rewards you bring, a .jsonl
# dataset with eval and sample grids -> `sp-diffusers export` -> `sp-diffusers sample` under SP.
#   bash examples/run_trainer_io_tiny.sh               # Qwen-Image (FAMILY=flux, sd3, wan or wan2.2 for the others)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
family=${FAMILY:-qwenimage}
pipe=runs/tiny-$family-pipeline run=runs/tiny-$family-sp2 out=runs/tiny-$family-export
[[ -f $pipe/model_index.json ]] || .venv/bin/python -c \
  "from sp_diffusers.tiny import save_tiny_pipeline; save_tiny_pipeline('$family', '$pipe', num_layers=2)"
.venv/bin/torchrun --standalone --nproc_per_node 2 --no-python .venv/bin/sp-diffusers train \
  --config examples/configs/tiny_pipeline_sp2.yaml --set "model.pipeline=$pipe" --out-dir "$run" "$@"
.venv/bin/sp-diffusers export --run "$run" --out "$out" --force   # a rerun replaces its own export
ext=png; [[ $family == wan* ]] && ext=mp4
.venv/bin/torchrun --standalone --nproc_per_node 2 --no-python .venv/bin/sp-diffusers sample --ulysses 2 \
  --pipeline "$out" --prompt "a red teapot" --prompt "a blue sailboat" --steps 6 --height 16 --width 16 \
  --max-sequence-length 256 --out "$run/sample.$ext"
