#!/usr/bin/env bash
# GPU variant for SD3.5-Medium (24 heads: Ulysses degrees 2, 4, 8 divide them), NCCL, bf16, LoRA.
#   PIPELINE=/path/to/stable-diffusion-3.5-medium NGPUS=8 SP=4 bash examples/run_flowgrpo_sd35m_gpu.sh
# The transformer comes from $PIPELINE/transformer; prompts go through the pipeline's own CLIP-L, CLIP-G
# (pooled) and T5 encoders (text.pipeline), on each rank's GPU in bf16, as StableDiffusion3Pipeline does.
# 128x128 latents (1024 px) -> 4096 image tokens + 333 text tokens (padded to the SP degree, masked).
# Ulysses x Ring beyond 24-way: add --set parallel.ring_degree=2 (SP = ulysses x ring).
set -euo pipefail
cd "$(dirname "$0")/.."
SP_TORCH=system SP_VENV=${SP_VENV:-.venv-gpu} bash scripts/setup.sh  # keeps this machine's CUDA torch
: "${PIPELINE:?set PIPELINE to a stable-diffusion-3.5-medium folder (diffusers layout)}"
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
exec "${SP_VENV:-.venv-gpu}/bin/torchrun" --standalone --nproc_per_node "$NGPUS" -m sp_diffusers.cli train \
  --config examples/configs/tiny_sd3_sp2.yaml --pretrained "$PIPELINE/transformer" \
  --set text.pipeline="$PIPELINE" --set text.max_sequence_length=256 \
  --set parallel.ulysses_sequence_parallel_size="${SP:-2}" --set parallel.mixed_precision=bf16 \
  --set lora.enabled=true --set lora.rank=32 --set model.image_size=128 \
  --set flowgrpo.micro_batch_size=2 \
  --set train.out_dir=runs/flowgrpo-sd35m "$@"
