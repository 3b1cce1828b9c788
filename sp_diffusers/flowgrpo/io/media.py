"""Writing what a model makes: images as PNG (one, or a grid), videos as MP4 (H.264 through diffusers'
``export_to_video``: imageio and imageio-ffmpeg, which ships its own ffmpeg, both in the ``[train]`` extra), or as
GIF where no video writer is installed; and reading a video back (:func:`read_video`: preference pairs of videos).

Pixels are float tensors in [0, 1]: ``[3, H, W]`` / ``[n, 3, H, W]`` for images, ``[F, 3, H, W]`` / ``[n, F, 3, H, W]``
for videos; several are tiled into one grid (a video grid tiles every frame).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

__all__ = ["VIDEO_SUFFIXES", "grid", "has_video_writer", "read_video", "save_image", "save_pixels", "save_video"]

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")  # read through imageio-ffmpeg


def grid(pixels: torch.Tensor, columns: int | None = None) -> torch.Tensor:
    """``[n, ..., 3, H, W]`` -> one ``[..., 3, rows H, columns W]`` tiling, row-major, a 2-pixel gap (black)."""
    n = pixels.shape[0]
    cols = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    h, w = pixels.shape[-2:]
    gap = 2 if n > 1 else 0
    out = pixels.new_zeros(*pixels.shape[1:-2], rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap)
    for i in range(n):
        r, c = divmod(i, cols)
        out[..., r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = pixels[i]
    return out


def _uint8(pixels: torch.Tensor):
    """``[..., 3, H, W]`` in [0, 1] -> uint8 numpy ``[..., H, W, 3]``."""
    return (pixels.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1).cpu().numpy()


def save_image(pixels: torch.Tensor, path: str | Path) -> Path:
    """One ``[3, H, W]`` image (or ``[n, 3, H, W]``, tiled) as a PNG (or any format PIL writes by suffix)."""
    from PIL import Image

    if pixels.ndim == 4:
        pixels = grid(pixels)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_uint8(pixels)).save(path)
    return path


def has_video_writer() -> bool:
    """Whether an MP4 can be written here: diffusers' ``export_to_video`` needs imageio and imageio-ffmpeg."""
    return bool(importlib.util.find_spec("imageio") and importlib.util.find_spec("imageio_ffmpeg"))


def save_video(frames: torch.Tensor, path: str | Path, fps: int = 8) -> Path:
    """``[F, 3, H, W]`` (or ``[n, F, 3, H, W]``, tiled) as ``path``; an ``.mp4`` becomes a ``.gif`` beside it when
    no video writer is installed. Returns the path written."""
    from PIL import Image

    if frames.ndim == 5:
        frames = grid(frames)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = list(_uint8(frames))
    if path.suffix.lower() == ".mp4" and has_video_writer():
        from diffusers.utils import export_to_video

        export_to_video([a.astype("float32") / 255.0 for a in arrays], str(path), fps=fps)
        return path
    if path.suffix.lower() != ".gif":
        path = path.with_suffix(".gif")
    images = [Image.fromarray(a) for a in arrays]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path


def save_pixels(pixels: torch.Tensor, stem: str | Path, fps: int = 8) -> Path:
    """Images ``[n, 3, H, W]`` -> ``stem.png``; videos ``[n, F, 3, H, W]`` -> ``stem.mp4`` (or ``.gif``)."""
    stem = Path(stem)
    if pixels.ndim == 5:
        return save_video(pixels, stem.with_suffix(".mp4"), fps)
    return save_image(pixels, stem.with_suffix(".png"))


def read_video(path: str | Path) -> torch.Tensor:
    """A video file's frames, ``[F, 3, H, W]`` uint8 RGB (imageio's ffmpeg reader)."""
    import imageio.v2 as imageio
    import numpy as np

    reader = imageio.get_reader(str(path), "ffmpeg")
    try:
        frames = np.stack([np.asarray(f)[..., :3] for f in reader])
    finally:
        reader.close()
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
