#!/usr/bin/env bash
# The same CPU job launched by `accelerate launch` instead of torchrun (accelerate sets RANK, WORLD_SIZE and
# MASTER_ADDR like torchrun does; sp-diffusers joins that process group). Extra arguments go to `train`.
# `--multi_gpu` is accelerate's name for its torchrun-based multi-process launcher; on a CPU-only host the
# processes use gloo. (`--cpu` with several processes would need mpirun.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --main_process_port "${PORT:-29533}" \
  -m sp_diffusers.cli train --config examples/configs/tiny_qwenimage_sp2.yaml \
  --set train.out_dir=runs/flowgrpo-tiny-sp2-accelerate "$@"
