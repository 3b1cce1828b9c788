#!/usr/bin/env bash
# Multi-node: run this on every node with the same MASTER_ADDR/MASTER_PORT (torchrun c10d rendezvous).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 bash examples/run_flowgrpo_multinode.sh --pretrained DIR
# Ulysses groups are adjacent ranks (the mesh's fastest dim), so with SP dividing GPUS_PER_NODE every
# all-to-all stays inside a node; FSDP and data parallelism span the nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR}"
SP_TORCH=system SP_VENV=${SP_VENV:-.venv-gpu} bash scripts/setup.sh  # keeps this machine's CUDA torch
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
SP=${SP:-2}
exec "${SP_VENV:-.venv-gpu}/bin/torchrun" --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-sp-diffusers}" \
  -m sp_diffusers.cli train --config examples/configs/tiny_qwenimage_sp2.yaml \
  --set parallel.ulysses_sequence_parallel_size="$SP" --set parallel.mixed_precision=bf16 \
  --set train.out_dir=runs/flowgrpo-multinode "$@"
