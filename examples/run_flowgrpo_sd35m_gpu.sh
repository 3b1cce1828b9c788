#!/usr/bin/env bash
# GPU variant for SD3.5-Medium (24 heads: Ulysses degrees 2, 4, 8 divide them), NCCL, bf16, LoRA.
#   TRANSFORMER=/path/to/stable-diffusion-3.5-medium/transformer NGPUS=8 SP=4 bash examples/run_flowgrpo_sd35m_gpu.sh
# Limitation: prompts are encoded by the embedded byte-level text model sized to SD3.5-M's text width
# (text.hidden_size=4096, pooled 2048 needs an adapter change); plugging the pipeline's own CLIP/T5
# encoders into FlowGRPOTrainer is not done yet — the loop, SP plan, engine and checkpoints are the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TRANSFORMER:?set TRANSFORMER to an SD3.5 transformer folder (save_pretrained layout)}"
NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}
exec torchrun --standalone --nproc_per_node "$NGPUS" -m sp_diffusers.cli train \
  --config examples/configs/tiny_sd3_sp2.yaml --pretrained "$TRANSFORMER" \
  --set parallel.ulysses_sequence_parallel_size="${SP:-2}" --set parallel.mixed_precision=bf16 \
  --set lora.enabled=true --set lora.rank=32 --set model.image_size=128 \
  --set train.out_dir=runs/flowgrpo-sd35m "$@"
