#!/usr/bin/env bash
# The real-run path on 2 CPU processes at tiny size: pipeline folder -> FlowGRPO with rewards you bring, a .jsonl
# dataset with eval and sample grids -> `sp-diffusers export` -> `sp-diffusers sample` under SP.
#   bash examples/run_trainer_io_tiny.sh               # Qwen-Image (FAMILY=flux, sd3, wan, wan2.2, zimage,
#                                                      # flux2-klein, flux2-dev, hunyuanvideo15 or ltx2 for the others)
#   FAMILY=qwenimage-edit bash examples/run_trainer_io_tiny.sh   # editing / I2V on image rows: flux-kontext,
#                                                      # qwenimage-edit, qwenimage-edit-plus (rows of 1 to 3
#                                                      # images), wan-i2v, wan2.2-i2v, wan2.2-ti2v
#   RUNS=/tmp/runs bash examples/run_trainer_io_tiny.sh  # where the pipeline, run and export go (default runs/)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
family=${FAMILY:-qwenimage} runs=${RUNS:-runs}
pipe=$runs/tiny-$family-pipeline run=$runs/tiny-$family-sp2 out=$runs/tiny-$family-export
[[ -f $pipe/model_index.json ]] || .venv/bin/python -c \
  "from sp_diffusers.tiny import save_tiny_pipeline; save_tiny_pipeline('$family', '$pipe', num_layers=2)"
config=examples/configs/tiny_pipeline_sp2.yaml size=16 length=256 image=() extra=()
case $family in
  flux-kontext | qwenimage-edit | wan-i2v | wan2.2-i2v | wan2.2-ti2v)
    # rows with a source image each; the edit families' tiny VAEs are 8x (64 x 64 px), Wan's 4x (32 x 32 px)
    config=examples/configs/tiny_image_cond_sp2.yaml size=32 length=512 image=(--image examples/data/images/blue.png)
    [[ $family == wan2.2-i2v ]] && extra=(--set flowgrpo.window_size=4 --set "flowgrpo.window_range=[0,1]")
    ;;
  qwenimage-edit-plus)
    # rows of 1, 2 and 3 source images in one run; the sample edits from two
    config=examples/configs/tiny_image_cond_sp2.yaml size=32 length=512
    image=(--image examples/data/images/blue.png --image examples/data/images/yellow.png)
    extra=(--set data.train=examples/data/edit_plus_train.jsonl --set data.eval=examples/data/edit_plus_eval.jsonl)
    ;;
  ltx2) size=32 ;;  # LTX2Pipeline samples at multiples of 32 pixels
esac
.venv/bin/torchrun --standalone --nproc_per_node 2 --no-python .venv/bin/sp-diffusers train \
  --config "$config" --set "model.pipeline=$pipe" --out-dir "$run" "${extra[@]}" "$@"
.venv/bin/sp-diffusers export --run "$run" --out "$out" --force   # a rerun replaces its own export
ext=png; [[ $family == wan* || $family == hunyuanvideo* || $family == ltx2 ]] && ext=mp4
# the edit pipelines resize the source to ~1 MP (4096 condition tokens with the tiny 8x VAE): one prompt there;
# LTX-2: one, so that its soundtrack is muxed into the MP4 (several: a WAV each beside a tiled MP4)
prompts=(--prompt "a red teapot")
[[ (${#image[@]} -eq 0 && $family != ltx2) || $family == wan* ]] && prompts+=(--prompt "a blue sailboat")
.venv/bin/torchrun --standalone --nproc_per_node 2 --no-python .venv/bin/sp-diffusers sample --ulysses 2 \
  --pipeline "$out" "${prompts[@]}" "${image[@]}" --steps 6 --height $size --width $size --frames 5 \
  --max-sequence-length $length --out "$run/sample.$ext"
