#!/usr/bin/env bash
# GPU variant of run_flowgrpo_sp2.sh: NCCL, bf16 compute with fp32 gradient reduction, Ulysses SP = 2 on
# every pair of GPUs (dp = GPUs / 2), same verl keys. MODEL_PATH: a Qwen-Image transformer folder
# (save_pretrained, or <snapshot>/transformer of Qwen/Qwen-Image); empty runs the tiny model on the GPUs.
# Usage: NGPUS=8 MODEL_PATH=/ckpt/qwen-image/transformer bash examples/verl/run_flowgrpo_sp2_gpu.sh [KEY=VALUE ...]
# Several nodes: NNODES=2 MASTER_ADDR=node0 on every node (torchrun's c10d rendezvous; --standalone is for one).
set -euo pipefail
cd "$(dirname "$0")/../.."
SP_TORCH=system SP_VENV=${SP_VENV:-.venv-gpu} bash scripts/setup.sh verl  # keeps this machine's CUDA torch
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
NNODES=${NNODES:-1}
if [ "$NNODES" = 1 ]; then
  launch=(--standalone)
else
  : "${MASTER_ADDR:?set MASTER_ADDR (the first node) when NNODES > 1}"
  launch=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
    --rdzv_id "${RDZV_ID:-sp-diffusers-verl}")
fi
model=()
if [ -n "${MODEL_PATH:-}" ]; then model=("actor_rollout_ref.model.path=$MODEL_PATH"); fi
exec "${SP_VENV:-.venv-gpu}/bin/torchrun" "${launch[@]}" --nproc_per_node "$NGPUS" -m sp_diffusers.cli train \
  --config examples/configs/tiny_qwenimage_sp2.yaml \
  actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=5e-4 \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
  trainer.n_gpus_per_node="$NGPUS" \
  trainer.nnodes="$NNODES" \
  trainer.default_local_dir=runs/verl-flowgrpo-sp2-gpu \
  "${model[@]}" "$@"
