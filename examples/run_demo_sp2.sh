#!/usr/bin/env bash
# A one-shot parity demo of the backend: tiny Qwen-Image built from the real diffusers class, forward +
# backward with `ulysses_sdpa` on 2 CPU ranks (torchrun, gloo), checked against one process.
# Extra arguments go to `sp-diffusers demo` (e.g. --model wan --backend native).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc_per_node 2 -m sp_diffusers.cli demo "$@"
