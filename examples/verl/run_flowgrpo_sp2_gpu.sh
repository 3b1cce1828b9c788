#!/usr/bin/env bash
# GPU variant of run_flowgrpo_sp2.sh: NCCL, bf16 compute with fp32 gradient reduction, Ulysses SP = 2 on
# every pair of GPUs (dp = GPUs / 2), same verl keys. MODEL_PATH: a Qwen-Image transformer folder
# (save_pretrained, or <snapshot>/transformer of Qwen/Qwen-Image); empty runs the tiny model on the GPUs.
# Usage: NGPUS=8 MODEL_PATH=/ckpt/qwen-image/transformer bash examples/verl/run_flowgrpo_sp2_gpu.sh [KEY=VALUE ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
NNODES=${NNODES:-1}
model=()
if [ -n "${MODEL_PATH:-}" ]; then model=("actor_rollout_ref.model.path=$MODEL_PATH"); fi
exec torchrun --standalone --nnodes "$NNODES" --nproc_per_node "$NGPUS" -m sp_diffusers.cli train \
  --config examples/configs/tiny_qwenimage_sp2.yaml \
  actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 \
  actor_rollout_ref.actor.strategy=fsdp2 \
  actor_rollout_ref.actor.optim.lr=5e-4 \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
  trainer.n_gpus_per_node="$NGPUS" \
  trainer.nnodes="$NNODES" \
  trainer.default_local_dir=runs/verl-flowgrpo-sp2-gpu \
  "${model[@]}" "$@"
