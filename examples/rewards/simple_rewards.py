"""Example rewards you bring (``flowgrpo.rewards: [{fn: "examples/rewards/simple_rewards.py:color_match", ...}]``).

Each takes ``(images_or_latents, prompts, metadata, **kwargs)`` and returns one float per sample. ``images`` are
``[b, 3, H, W]`` (video ``[b, F, 3, H, W]``) in [0, 1]; ``metadata`` holds each sample's dataset row (a ``.jsonl``
prompt file's other fields). They are cheap on purpose: they show the interface, not a model of taste (see
docs/rewards.md for PickScore, HPSv2, ImageReward and CLIP).
"""

from __future__ import annotations

import torch

CHANNELS = {"red": 0, "green": 1, "blue": 2}


def brightness(images: torch.Tensor, prompts: list[str], metadata: list[dict], target: float = 0.6) -> torch.Tensor:
    """How close the mean pixel value is to ``target``: ``-|mean - target|`` (0 is best)."""
    return -(images.float().flatten(1).mean(dim=1) - target).abs()


def color_match(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """The mean of the row's ``color`` channel minus the mean of the other two (a row without one scores 0)."""
    rgb = images.float().movedim(-3, 0).flatten(2).mean(dim=2)  # [3, b]: over pixels (and frames)
    scores = []
    for b, row in enumerate(metadata):
        c = CHANNELS.get(str(row.get("color", "")).lower())
        scores.append(0.0 if c is None else float(rgb[c, b] - (rgb[:, b].sum() - rgb[c, b]) / 2))
    return torch.tensor(scores)


def source_similarity(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """An edit reward: how close the output stays to the source image, ``-mean |output - source|`` (0 is best).

    Editing and image-to-video runs give each sample's source image(s) as pixels beside the row's fields:
    ``metadata[i]["source_image"]`` is ``[3, H, W]`` in [0, 1] at the output's size (``"source_images"``: all of the
    row's). A video is compared by its first frame (image-to-video: the frame the source becomes)."""
    first = images[:, 0] if images.dim() == 5 else images
    sources = torch.stack([row["source_image"] for row in metadata]).to(first)
    return -(first.float() - sources.float()).abs().flatten(1).mean(dim=1)


def loudness(images: torch.Tensor, prompts: list[str], metadata: list[dict], target: float = 0.1) -> torch.Tensor:
    """An audio reward (LTX-2: the soundtrack beside the video): how close the waveform's RMS level is to ``target``,
    ``-|rms - target|`` (0 is best).

    A family that makes sound gives each sample's waveform beside the row's fields: ``metadata[i]["audio"]`` is
    ``[channels, samples]`` float32 in [-1, 1] and ``metadata[i]["audio_sample_rate"]`` its rate (Hz)."""
    rms = torch.stack([row["audio"].float().square().mean().sqrt() for row in metadata])
    return -(rms - target).abs()
