#!/usr/bin/env bash
# FlowGRPO on a tiny SD3.5-style model (real SD3Transformer2DModel) with Ulysses SP = 2 on 2 CPU processes.
# diffusers has no context-parallel plan for SD3: sp_diffusers.install() attaches one (sp_diffusers/plans.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m sp_diffusers.cli train \
  --config examples/configs/tiny_sd3_sp2.yaml "$@"
