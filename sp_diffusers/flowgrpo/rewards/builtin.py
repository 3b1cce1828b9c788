"""Rewards behind one small interface: ``reward(latents, prompts) -> [B]``.

``latents`` are the final denoised latents the rollout produced, channels last (``[B, L, C]`` tokens for
images, ``[B, F, H, W, C]`` for video: ``adapter.reward_view``); a reward that needs pixels decodes them itself (e.g. with the pipeline's VAE) and a
reward model that reads text takes the prompts. Rewards run on every rank of an SP group on identical
inputs, so they are identical there too.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ...parallel.devices import to_device
from ..models.text import COLORS

__all__ = ["REWARDS", "ColorLatentReward", "MeanLatentReward", "Reward", "VideoColorReward", "build_reward"]


@runtime_checkable
class Reward(Protocol):
    def __call__(self, latents: torch.Tensor, prompts: list[str]) -> torch.Tensor:  # pragma: no cover
        """``[B, ...]`` final latents + B prompts -> ``[B]`` float rewards (higher is better)."""
        ...


class ColorLatentReward:
    """Cosine similarity between the token-mean latent and the direction of the prompt's colour.

    Each colour word (``red``, ``green``, ``blue``, ``yellow``) owns a fixed random unit direction in latent
    channel space; the policy must learn to steer the image's mean latent towards it, conditioned on the
    prompt. In [-1, 1]; a tiny Qwen-Image learns it in minutes on CPU.
    """

    def __init__(self, channels: int, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        directions = torch.randn(len(COLORS), channels, generator=g)
        self.directions = directions / directions.norm(dim=-1, keepdim=True)

    def color_index(self, prompt: str) -> int:
        words = prompt.lower().split()
        for i, color in enumerate(COLORS):
            if color in words:
                return i
        raise ValueError(f"prompt {prompt!r} names none of the colours {COLORS}; ColorLatentReward needs one")

    def __call__(self, latents: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if latents.shape[0] != len(prompts):
            raise ValueError(f"{latents.shape[0]} latents but {len(prompts)} prompts")
        mean = latents.float().flatten(1, -2).mean(dim=1)  # [B, C]
        targets = to_device(self.directions[[self.color_index(p) for p in prompts]], mean.device)
        return torch.nn.functional.cosine_similarity(mean, targets, dim=-1)


class VideoColorReward:
    """The prompt's colour in every frame, held steady across frames: ``exp(-(colour_err + w temporal) / s)``.

    With ``m[b, f]`` the mean latent of frame f (over its pixels, ``[C]``) and ``t`` the target of the prompt's
    colour word (the direction of :class:`ColorLatentReward` times ``scale``)::

        colour_err = mean_{f, c} (m[b, f, c] - t_c)^2          every frame must hit the target
        temporal   = mean_{f >= 1, c} (m[b, f, c] - m[b, f - 1, c])^2    frame-to-frame drift

    In (0, 1]; dense and smooth, prompt-conditioned (the text path must work) and a function of every frame (so
    under SP the frames must all be there: the engine's output is gathered). A tiny Wan learns it in about a
    minute on CPU (``examples/run_flowgrpo_wan_sp2.sh``). Image latents ``[B, L, C]`` count as one frame.
    """

    def __init__(
        self,
        channels: int,
        seed: int = 7,
        scale: float = 1.0,
        temporal_weight: float = 1.0,
        temperature: float = 0.5,
    ) -> None:
        self.targets = ColorLatentReward(channels, seed).directions * scale
        self.color_index = ColorLatentReward(channels, seed).color_index
        self.temporal_weight, self.temperature = temporal_weight, temperature

    def __call__(self, latents: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if latents.shape[0] != len(prompts):
            raise ValueError(f"{latents.shape[0]} latents but {len(prompts)} prompts")
        x = latents.float()
        frames = x.flatten(2, -2).mean(dim=2) if x.ndim >= 4 else x.mean(dim=1, keepdim=True)  # [B, F, C]
        targets = to_device(self.targets[[self.color_index(p) for p in prompts]], frames.device)
        colour_err = ((frames - targets[:, None, :]) ** 2).mean(dim=(1, 2))
        if frames.shape[1] > 1:
            temporal = ((frames[:, 1:] - frames[:, :-1]) ** 2).mean(dim=(1, 2))
        else:
            temporal = torch.zeros_like(colour_err)
        return torch.exp(-(colour_err + self.temporal_weight * temporal) / self.temperature)


class MeanLatentReward:
    """The mean of the final latents: prompt-independent, the simplest signal (for smoke tests)."""

    def __call__(self, latents: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return latents.float().flatten(1).mean(dim=1)


REWARDS = {"color": ColorLatentReward, "mean_latent": MeanLatentReward, "video_color": VideoColorReward}


def build_reward(name: str, channels: int) -> Reward:
    if name == "color":
        return ColorLatentReward(channels)
    if name == "video_color":
        return VideoColorReward(channels)
    if name == "mean_latent":
        return MeanLatentReward()
    raise ValueError(f"reward={name!r} is not built in; choose one of {sorted(REWARDS)} or pass a callable")
