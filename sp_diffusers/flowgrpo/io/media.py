"""Writing what a model makes: images as PNG (one, or a grid), videos as MP4 (H.264 through diffusers'
``export_to_video``: imageio and imageio-ffmpeg, which ships its own ffmpeg, both in the ``[train]`` extra), or as
GIF where no video writer is installed; a soundtrack (LTX-2) as a 16-bit WAV beside the video and, for one video,
muxed into its MP4 as AAC (:func:`save_video` with ``audio``); and reading a video back (:func:`read_video`:
preference pairs of videos).

Pixels are float tensors in [0, 1]: ``[3, H, W]`` / ``[n, 3, H, W]`` for images, ``[F, 3, H, W]`` / ``[n, F, 3, H, W]``
for videos; several are tiled into one grid (a video grid tiles every frame).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

__all__ = [
    "VIDEO_SUFFIXES",
    "grid",
    "has_video_writer",
    "read_video",
    "read_wav",
    "save_image",
    "save_pixels",
    "save_video",
    "save_wav",
]

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


def save_video(
    frames: torch.Tensor, path: str | Path, fps: float = 8, audio: torch.Tensor | None = None, sample_rate: int = 0
) -> Path:
    """``[F, 3, H, W]`` (or ``[n, F, 3, H, W]``, tiled) as ``path``; an ``.mp4`` becomes a ``.gif`` beside it when
    no video writer is installed. ``audio``: each video's waveform ``[channels, samples]`` (or ``[n, channels,
    samples]``) in [-1, 1] at ``sample_rate``, written beside as ``<stem>.wav`` (``<stem>.<i>.wav`` for several) and,
    for one video in an MP4, muxed into it. Returns the path written."""
    from PIL import Image

    if frames.ndim == 5:
        count = frames.shape[0]
        frames = grid(frames)
    else:
        count = 1
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = list(_uint8(frames))
    waves: list[Path] = []
    if audio is not None:
        audio = audio.reshape(-1, *audio.shape[-2:]) if audio.ndim >= 2 else audio[None, None]
        if audio.shape[0] != count:
            raise ValueError(f"save_video: {audio.shape[0]} soundtracks for {count} videos")
        stems = [path.with_suffix(".wav")] if count == 1 else [path.with_suffix(f".{i}.wav") for i in range(count)]
        waves = [save_wav(a, p, sample_rate) for a, p in zip(audio, stems, strict=True)]
    if path.suffix.lower() == ".mp4" and has_video_writer():
        from diffusers.utils import export_to_video

        if len(waves) != 1:
            export_to_video([a.astype("float32") / 255.0 for a in arrays], str(path), fps=fps)
            return path
        silent = path.with_suffix(".silent.mp4")
        export_to_video([a.astype("float32") / 255.0 for a in arrays], str(silent), fps=fps)
        _mux(silent, waves[0], path)
        return path
    if path.suffix.lower() != ".gif":
        path = path.with_suffix(".gif")
    images = [Image.fromarray(a) for a in arrays]
    images[0].save(path, save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)
    return path


def _mux(video: Path, wav: Path, out: Path) -> None:
    """``video`` (removed after) with ``wav`` as its AAC track -> ``out`` (imageio-ffmpeg's own ffmpeg)."""
    import subprocess

    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-i", str(video), "-i", str(wav)]
    command += ["-c:v", "copy", "-c:a", "aac", str(out)]  # every frame kept, whichever track is longer
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"muxing {wav} into {out} failed (ffmpeg: {done.stderr.strip()[-400:]})")
    video.unlink()


def save_wav(wave: torch.Tensor, path: str | Path, sample_rate: int) -> Path:
    """A waveform ``[channels, samples]`` (or ``[samples]``) in [-1, 1] as a 16-bit PCM WAV (clipped to [-1, 1])."""
    import wave as wavefile

    if sample_rate < 1:
        raise ValueError(f"save_wav: sample_rate={sample_rate} must be >= 1 (the vocoder's output rate)")
    data = wave.detach().float().cpu()
    data = data[None] if data.ndim == 1 else data
    pcm = (data.clamp(-1, 1) * 32767).round().to(torch.int16).t().contiguous()  # interleaved frames
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with wavefile.open(str(path), "wb") as f:
        f.setnchannels(data.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(pcm.numpy().tobytes())
    return path


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """A 16-bit PCM WAV as (``[channels, samples]`` float32 in [-1, 1], sample rate)."""
    import wave as wavefile

    import numpy as np

    with wavefile.open(str(path), "rb") as f:
        if f.getsampwidth() != 2:
            raise ValueError(f"read_wav: {path} is {8 * f.getsampwidth()}-bit; 16-bit PCM is read here")
        channels, rate = f.getnchannels(), f.getframerate()
        data = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
    return torch.from_numpy(data.astype("float32") / 32767).reshape(-1, channels).t().contiguous(), rate


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
