#!/usr/bin/env bash
# Offline Diffusion-DPO on a tiny preference data set: writes a tiny Qwen-Image pipeline folder and its pairs
# (examples/tiny_preference_pairs.py) under runs/dpo-offline-data, then trains on the pairs at Ulysses SP = 2 on 2 CPU
# processes, the held-out pairs' implicit reward margin evaluated every 4 iterations. Extra arguments go to
# `sp-diffusers train` (e.g. --iterations 40).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=runs/dpo-offline-data
[ -f "$DATA/eval.jsonl" ] || .venv/bin/python examples/tiny_preference_pairs.py "$DATA"
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m sp_diffusers.cli train \
  --config examples/configs/tiny_diffusion_dpo_offline_sp2.yaml "$@"
