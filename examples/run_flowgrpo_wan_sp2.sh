#!/usr/bin/env bash
# FlowGRPO on a tiny Wan (real WanTransformer3DModel, video latents) with Ulysses SP = 2 on 2 CPU processes.
#   bash examples/run_flowgrpo_wan_sp2.sh                   # built-in tiny UMT5 text encoder, Wan's UniPC schedule
#   DANCE=1 bash examples/run_flowgrpo_wan_sp2.sh           # DanceGRPO instead (its SDE on every step, shift-3
#       linspace schedule, eta 0.3, a random 60 % of steps 0..N-2 trained per video)
#   PIPELINE=1 bash examples/run_flowgrpo_wan_sp2.sh        # a tiny WanPipeline folder is written first; the
#       transformer is loaded from it, prompts go through its own UMT5 + tokenizer and the schedule comes from its
#       scheduler config: the path of a real Wan2.1-T2V-1.3B-Diffusers checkpoint
# Extra arguments go to `sp-diffusers train` (e.g. --iterations 20, --set flowgrpo.sde_type=cps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
extra=()
if [[ -n "${DANCE:-}" ]]; then
  extra+=(--set flowgrpo.algorithm=dance_grpo --set flowgrpo.noise_level=0.3 --set flowgrpo.shift=3.0
          --set flowgrpo.timestep_fraction=0.6 --set flowgrpo.clip_range=1.0e-4 --set flowgrpo.drop_zero_advantage=false)
fi
if [[ -n "${PIPELINE:-}" ]]; then
  folder=runs/tiny-wan-pipeline
  [[ -f $folder/model_index.json ]] || .venv/bin/python -c \
    "from sp_diffusers.tiny import save_tiny_wan_pipeline; save_tiny_wan_pipeline('$folder', num_layers=2)"
  extra+=(--pretrained "$folder/transformer" --set "text.pipeline=$folder")
fi
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m sp_diffusers.cli train \
  --config examples/configs/tiny_wan_sp2.yaml "${extra[@]}" "$@"
