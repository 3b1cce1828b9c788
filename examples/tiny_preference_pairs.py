"""Write a tiny offline preference data set for Diffusion-DPO beside a tiny Qwen-Image pipeline folder.

    python examples/tiny_preference_pairs.py OUT_DIR [--train 12] [--eval 16]

OUT_DIR/pipeline is a QwenImagePipeline saved from the real diffusers classes with small configs (random weights);
OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl hold {"prompt", "chosen", "rejected"} rows whose images (16 x 16, the
size the tiny pipeline's latents decode to at model.image_size 8) prefer a noisy red picture to a noisy blue one.
examples/run_diffusion_dpo_offline_tiny.sh trains on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from PIL import Image

from sp_diffusers.tiny import save_tiny_pipeline

PROMPTS = ["a red cat", "a red house", "a red teapot", "a red car", "a red apple", "a red boat"]
SIZE = 16  # pixels: model.image_size 8 x the tiny VAE's 2x spatial compression


def write_pairs(root: Path, name: str, count: int, rng: np.random.Generator) -> Path:
    rows = []
    for i in range(count):
        for side, colour in (("chosen", (220, 30, 30)), ("rejected", (30, 30, 220))):
            pixels = np.asarray(colour, dtype=np.float64)[None, None, :] + rng.normal(0.0, 25.0, (SIZE, SIZE, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / f"{name}{i}_{side}.png")
        rows.append({"prompt": PROMPTS[i % len(PROMPTS)], "chosen": f"{name}{i}_chosen.png",
                     "rejected": f"{name}{i}_rejected.png"})
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=12, help="training pairs")
    parser.add_argument("--eval", type=int, default=16, help="held-out pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_tiny_pipeline("qwenimage", args.out_dir / "pipeline", seed=args.seed, num_layers=2)
    rng = np.random.default_rng(args.seed)
    for name, count in (("train", args.train), ("eval", args.eval)):
        print(write_pairs(args.out_dir, name, count, rng))


if __name__ == "__main__":
    main()
