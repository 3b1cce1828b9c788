#!/usr/bin/env bash
# GPU variant: NCCL, bf16 compute with fp32 gradient reduction, Ulysses SP = 2 on every pair of GPUs and
# data parallelism across pairs (dp = GPUs / 2). Point --pretrained at a Qwen-Image transformer folder
# (e.g. <snapshot>/transformer of Qwen/Qwen-Image) for a real model; without it the tiny model runs on GPU.
# Usage: NGPUS=8 bash examples/run_flowgrpo_sp2_gpu.sh [--pretrained DIR] [--set key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
SP_TORCH=system SP_VENV=${SP_VENV:-.venv-gpu} bash scripts/setup.sh  # keeps this machine's CUDA torch
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
exec "${SP_VENV:-.venv-gpu}/bin/torchrun" --standalone --nproc_per_node "$NGPUS" -m sp_diffusers.cli train \
  --config examples/configs/tiny_qwenimage_sp2.yaml \
  --set parallel.mixed_precision=bf16 \
  --set train.out_dir=runs/flowgrpo-sp2-gpu "$@"
