#!/usr/bin/env bash
# FlowGRPO on a tiny SD3.5-style model (real SD3Transformer2DModel) with Ulysses SP = 2 on 2 CPU processes.
# diffusers has no context-parallel plan for SD3: sp_diffusers.install() attaches one (sp_diffusers/patching/plans.py).
#   bash examples/run_flowgrpo_sd3_sp2.sh                 # prompts through the built-in byte-level encoder
#   PIPELINE=1 bash examples/run_flowgrpo_sd3_sp2.sh      # a tiny StableDiffusion3Pipeline folder is written
#       first; the transformer is loaded from it and prompts go through its own CLIP-L/CLIP-G/T5 encoders,
#       exactly the path of run_flowgrpo_sd35m_gpu.sh with the real checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
extra=()
if [[ -n "${PIPELINE:-}" ]]; then
  folder=runs/tiny-sd3-pipeline
  [[ -f $folder/model_index.json ]] || .venv/bin/python -c \
    "from sp_diffusers.tiny import save_tiny_sd3_pipeline; save_tiny_sd3_pipeline('$folder', num_layers=2)"
  extra=(--pretrained "$folder/transformer" --set "text.pipeline=$folder" --set text.max_sequence_length=16)
fi
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m sp_diffusers.cli train \
  --config examples/configs/tiny_sd3_sp2.yaml "${extra[@]}" "$@"
