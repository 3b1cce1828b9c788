"""A real-model reward: CLIP's text-image similarity, from a local ``transformers`` CLIP folder (nothing downloaded).

Use it from a config::

    flowgrpo:
      rewards:
        - {fn: "sp_diffusers.flowgrpo.rewards.clip:clip_score", weight: 1.0, input: pixels,
           kwargs: {model: /models/clip-vit-large-patch14}}

The folder is what ``CLIPModel.save_pretrained`` + the tokenizer's ``save_pretrained`` write (a downloaded
``openai/clip-vit-*`` repository is one); ``preprocessor_config.json`` gives the image size, mean and std when it is
there. Images ``[b, 3, H, W]`` in [0, 1] are resized (shorter side, bicubic) and centre-cropped to CLIP's input size
and normalised in torch, so nothing goes through PIL; a video ``[b, F, 3, H, W]`` scores the mean over its frames.
The score is the cosine similarity of the image and prompt embeddings (in [-1, 1]) times ``scale``; the common
"CLIP score" is ``100 * max(cos, 0)`` (``scale=100``, ``clamp=True``). Loaded once per process and device.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["clip_score"]

# OpenAI CLIP's preprocessing constants, used when the folder has no preprocessor_config.json
_MEAN = (0.48145466, 0.4578275, 0.40821073)
_STD = (0.26862954, 0.26130258, 0.27577711)


@functools.lru_cache(maxsize=4)
def _load(model: str, device: str, dtype: torch.dtype) -> tuple[Any, Any, int, torch.Tensor, torch.Tensor]:
    from transformers import AutoTokenizer, CLIPModel

    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"clip_score: model={model!r} is not a CLIP folder (no config.json); fix: kwargs: {{model: <a folder "
            "written by CLIPModel.save_pretrained, e.g. a downloaded openai/clip-vit-large-patch14>}}"
        )
    clip = CLIPModel.from_pretrained(folder, torch_dtype=dtype).to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    size, mean, std = clip.config.vision_config.image_size, _MEAN, _STD
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        cfg = json.loads(pre.read_text())
        crop = cfg.get("crop_size", size)
        size = int(crop.get("height", size) if isinstance(crop, dict) else crop)
        mean, std = cfg.get("image_mean", mean), cfg.get("image_std", std)
    as_t = functools.partial(torch.tensor, dtype=torch.float32, device=device)
    return clip, tokenizer, size, as_t(mean).view(1, 3, 1, 1), as_t(std).view(1, 3, 1, 1)


def _preprocess(images: torch.Tensor, size: int, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[n, 3, H, W]`` in [0, 1] -> CLIP's normalised ``[n, 3, size, size]`` (resize the shorter side, centre crop)."""
    h, w = images.shape[-2:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = torch.nn.functional.interpolate(images, size=(nh, nw), mode="bicubic", align_corners=False)
    top, left = (nh - size) // 2, (nw - size) // 2
    x = x[..., top : top + size, left : left + size].clamp(0, 1)
    return (x - mean) / std


@torch.no_grad()
def clip_score(
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
    model: str = "",
    scale: float = 1.0,
    clamp: bool = False,
    device: str | None = None,
    dtype: str = "float32",
) -> torch.Tensor:
    """``[b]`` cosine similarities between each image (or video, frame mean) and its prompt under CLIP ``model``."""
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(
            f"clip_score: images must be [b, 3, H, W] or [b, F, 3, H, W] in [0, 1] (input: pixels), got "
            f"{tuple(images.shape)}"
        )
    device = device or str(images.device)
    clip, tokenizer, size, mean, std = _load(model, device, getattr(torch, dtype))
    frames = images.shape[1] if images.ndim == 5 else 1
    flat = images.reshape(-1, *images.shape[-3:]).to(device, torch.float32)
    pixels = _preprocess(flat, size, mean, std).to(clip.dtype)
    max_length = clip.config.text_config.max_position_embeddings
    tok = tokenizer(list(prompts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    out = clip(
        input_ids=tok.input_ids.to(device),
        attention_mask=tok.attention_mask.to(device),
        pixel_values=pixels,
    )
    image = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1).view(len(prompts), frames, -1)
    text = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
    cos = (image * text[:, None, :]).sum(-1).mean(dim=1)
    return scale * (cos.clamp_min(0) if clamp else cos)
