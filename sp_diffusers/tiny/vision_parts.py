"""Tiny parts of the image-conditioned pipelines (nothing downloaded): Qwen-Image-Edit's vision-language encoder with
its processor, Wan2.1 I2V's CLIP vision encoder with its image processor, and VAEs that compress 8x like the released
ones.

- ``tiny_qwen_vl_processor``: a ``Qwen2VLProcessor`` whose tokenizer is the character tokenizer plus the chat and
  vision special tokens (``<|vision_start|>``, ``<|image_pad|>``, ...), and a PIL ``Qwen2VLImageProcessor`` with
  4-pixel patches merged 2 x 2 and few pixels (``max_pixels``): an edit prompt holds a handful of vision tokens.
- ``tiny_qwen25vl_vision``: ``Qwen2_5_VLForConditionalGeneration`` whose config names those special tokens' ids, so
  its vision tower reads the image the processor put in the prompt.
- ``tiny_clip_vision``: ``CLIPVisionModel`` (32 x 32 images, 8-pixel patches: 17 tokens) + ``CLIPImageProcessor``.
- ``save_tiny_dino``: a ``Dinov2Model`` folder (32 x 32 images) with its ``preprocessor_config.json``: GARDO's image
  features (``flowgrpo.gardo.features``).
- 8x VAEs: the pipelines resize a condition image to about 1 MP (Qwen-Image-Edit, FLUX.1 Kontext) whatever the
  output size; a 2x VAE would make that 65k condition tokens, an 8x one 4k, as the released VAEs do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .text_parts import WORDS, _seeded, qwen25vl

__all__ = [
    "QWEN_VL_SPECIAL",
    "save_qwen_vl_processor",
    "save_tiny_dino",
    "tiny_clip_vision",
    "tiny_qwen25vl_vision",
    "tiny_qwen_vl_processor",
]

# the Qwen2.5-VL chat / vision tokens the edit pipelines' templates use, appended to the character vocabulary
QWEN_VL_SPECIAL = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _token_id(token: str) -> int:
    return len(WORDS) + QWEN_VL_SPECIAL.index(token)


def tiny_qwen_vl_processor(max_length: int = 2048) -> Any:
    """``Qwen2VLProcessor`` (``sp_diffusers.families.processors``): the character tokenizer with ``QWEN_VL_SPECIAL`` as single tokens, and a PIL image
    processor (patch 4, merge 2, one temporal patch) capped at 32 x 32 pixels (16 vision tokens after merging)."""
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ..families.processors import qwen_vl_processor
    from .text_parts import char_tokenizer

    tokenizer = char_tokenizer(max_length)
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, special=True, normalized=False) for t in QWEN_VL_SPECIAL
            ]
        }
    )
    for token in QWEN_VL_SPECIAL:
        assert tokenizer.convert_tokens_to_ids(token) == _token_id(token), token
    images = Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=1,
        min_pixels=8 * 8,
        max_pixels=32 * 32,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return qwen_vl_processor(images, tokenizer)  # without torchvision: no video processor (processors.py)


def save_qwen_vl_processor(processor: Any, folder: Any) -> Any:
    """The processor's parts written as ``Qwen2VLProcessor.save_pretrained`` lays them out (``processors.py``)."""
    from ..families.processors import save_qwen_vl_processor as save

    return save(processor, folder)


def tiny_qwen25vl_vision(seed: int, hidden: int = 32) -> Any:
    """``Qwen2_5_VLForConditionalGeneration`` reading text and images (``tiny_qwen_vl_processor``'s tokens), ``hidden``
    wide: one text layer, one vision block of 4-pixel patches merged 2 x 2."""
    names = ("image_pad", "video_pad", "vision_start", "vision_end")
    ids = {f"{n.removesuffix('_pad')}_token_id": _token_id(f"<|{n}|>") for n in names}
    return qwen25vl(seed, hidden, len(WORDS) + len(QWEN_VL_SPECIAL), 4096, {"in_chans": 3}, **ids)


def tiny_clip_vision(seed: int, hidden: int = 16) -> tuple[Any, Any]:
    """``(CLIPImageProcessor, CLIPVisionModel)``: 32 x 32 images in 8-pixel patches (16 + 1 tokens), ``hidden`` wide;
    Wan2.1 I2V reads its penultimate hidden states (``image_dim`` = ``hidden``)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    config = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=hidden,
    )
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    return processor, _seeded(seed, lambda: CLIPVisionModel(config)).eval()




def save_tiny_dino(folder: str | os.PathLike, seed: int = 0, hidden: int = 32) -> Path:
    """Write a tiny random ``Dinov2Model`` (32 x 32 images in 8-pixel patches, ``hidden`` wide) and a
    ``preprocessor_config.json`` (ImageNet's mean and std) to ``folder``: what a downloaded DINOv2 holds."""
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    folder = Path(folder)
    _seeded(seed, lambda: Dinov2Model(config)).eval().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "crop_size": {"height": 32, "width": 32},
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
            }
        )
    )
    return folder
