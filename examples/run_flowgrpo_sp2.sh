#!/usr/bin/env bash
# The README's main command: FlowGRPO on a tiny Qwen-Image (real diffusers class, random weights) with
# Ulysses SP = 2 on 2 CPU processes (torchrun, gloo), FSDP2 over both. Prompts come from a tiny random
# transformers text model over UTF-8 bytes (ragged, so the engine pads them); the reward is the built-in
# colour reward. Writes metrics.jsonl, metrics.png and checkpoints under runs/flowgrpo-tiny-sp2.
# Extra arguments go to `sp-diffusers train` (e.g. --iterations 20, --set flowgrpo.group_size=8,
# --pretrained DIR for a transformer folder written by save_pretrained).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CMD=(-m sp_diffusers.cli train --config examples/configs/tiny_qwenimage_sp2.yaml "$@")
case " $* " in
  *" --print-config "* | *" --check "* | *" -h "* | *" --help "*) exec .venv/bin/python "${CMD[@]}" ;;
esac
# A mistake in the command or the config: one message from one process, before torchrun starts two.
.venv/bin/python "${CMD[@]}" --check >/dev/null
exec .venv/bin/torchrun --standalone --nproc_per_node 2 "${CMD[@]}"
