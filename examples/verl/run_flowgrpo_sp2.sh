#!/usr/bin/env bash
# FlowGRPO on the tiny Qwen-Image driven by verl's config keys: the engine is built through verl's
# EngineRegistry (sp-diffusers' verl plugin) and Ulysses SP is turned on by verl's own flag,
# actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size. CPU default: 2 gloo processes
# (VERL_PLATFORM=cpu, sp-diffusers' CPU platform for verl). Extra arguments go to `sp-diffusers train`
# (e.g. --iterations 4, --out-dir DIR, more KEY=VALUE overrides). GPU variant: run_flowgrpo_sp2_gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh verl
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export VERL_PLATFORM=${VERL_PLATFORM:-cpu}
NNODES=1
NPROC=2
exec .venv/bin/torchrun --standalone --nnodes "$NNODES" --nproc_per_node "$NPROC" -m sp_diffusers.cli train \
  --config examples/configs/tiny_qwenimage_sp2.yaml \
  actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=5e-4 \
  trainer.n_gpus_per_node="$NPROC" \
  trainer.nnodes="$NNODES" \
  trainer.default_local_dir=runs/verl-flowgrpo-tiny-sp2 \
  "$@"
