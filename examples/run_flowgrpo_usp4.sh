#!/usr/bin/env bash
# FlowGRPO with Ulysses x Ring on 4 CPU processes: ulysses 2 x ring 2 share every sample (dp = 1). The
# tiny Qwen-Image has 4 heads; the ring is how the SP degree goes beyond what the heads allow (Ulysses
# alone needs heads % degree == 0). K/V segments stream around the ring (sp_diffusers/parallel/ring.py).
#   bash examples/run_flowgrpo_usp4.sh                                   # U2 x R2
#   RING=4 ULYSSES=1 bash examples/run_flowgrpo_usp4.sh                  # a pure ring of 4
# Through verl keys the same is: actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2
# +actor_rollout_ref.model.ring_degree=2 (verl's engine config has no ring field).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc_per_node 4 -m sp_diffusers.cli train \
  --config examples/configs/tiny_qwenimage_sp2.yaml \
  --set parallel.ulysses_sequence_parallel_size="${ULYSSES:-2}" --set parallel.ring_degree="${RING:-2}" \
  --out-dir runs/flowgrpo-tiny-usp4 "$@"
