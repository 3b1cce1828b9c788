"""What a rollout keeps for training: the stochastic span's latents and log-probs, which steps each sample trains,
and the final latents the rewards read.

Stored per sample: ``latents [B, S+1, ...]`` (the span's inputs and outputs), ``log_probs [B, S]``,
``train_steps [B, T]`` (the schedule steps each sample trains on: the whole window for Flow-GRPO, a random subset per
sample for DanceGRPO) and ``final``; on request the span's step means ``means [B, S, ...]`` (GRPO-Guard's old policy).
With one window start per sample, each sample's window sits at its own positions (``starts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Trajectory"]


@dataclass
class Trajectory:
    latents: torch.Tensor  # [B, S+1, ...] float32: the span's inputs and outputs
    log_probs: torch.Tensor  # [B, S] the rollout's log-probs of the span's steps
    window_start: int  # index into the schedule of the span's first step
    final: torch.Tensor  # [B, ...] the denoised latents (reward input)
    train_steps: torch.Tensor | None = None  # [B, T] schedule steps to train on; None: every span step
    host_steps: list[int] | None = None  # the T trained steps when every sample shares them (two experts)
    starts: torch.Tensor | None = None  # [B] long: each sample's first span step (per-sample windows); None: window_start
    means: torch.Tensor | None = None  # [B, S, ...] the rollout's step means, when the rollout was asked to keep them
    old_means: torch.Tensor | None = None  # [B, T, ...] the old policy's step means at the trained steps (collect.py)
    noise_seed: int | None = None  # DiffusionNFT: the forward process's noise (StepPlan.noise_seed)

    @classmethod
    def of_data(cls, final: torch.Tensor) -> Trajectory:
        """Data without a rollout (offline preference pairs): no span, no log-probs; ``final`` is the data."""
        return cls(final.new_zeros((final.shape[0], 0, *final.shape[1:])), final.new_zeros((final.shape[0], 0)), 0, final)

    def host_step(self, k: int) -> int | None:
        """The schedule step of the k-th trained step as a host int when every sample shares it, else None."""
        if self.train_steps is None:
            return self.window_start + k
        return self.host_steps[k] if self.host_steps is not None else None

    def steps(self) -> torch.Tensor:
        """``[B, T]`` long: the schedule step of each sample's k-th trained step."""
        if self.train_steps is not None:
            return self.train_steps.to(self.latents.device)
        b, s = self.latents.shape[0], self.latents.shape[1] - 1
        return (self.window_start + torch.arange(s, device=self.latents.device)).expand(b, s)

    def _first(self, idx: torch.Tensor | None = None) -> torch.Tensor | int:
        """The span's first schedule step of samples ``idx`` (all: ``[B, 1]``), or the shared ``window_start``."""
        if self.starts is None:
            return self.window_start
        starts = self.starts.to(self.latents.device)
        return starts[:, None] if idx is None else starts[idx]

    def step_latents(self, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step indices ``[b]``, latents ``[b, ...]``, next latents ``[b, ...]``) of samples ``idx``' k-th
        trained step."""
        steps = self.steps()[idx, k]
        pos = steps - self._first(idx)
        return steps, self.latents[idx, pos], self.latents[idx, pos + 1]

    def rollout_log_probs(self) -> torch.Tensor:
        """``[B, T]``: the rollout's log-prob of each trained step (old log-probs without recomputation); zeros
        for a rollout without stochastic steps (an algorithm without a ratio reads none)."""
        pos = self.steps() - self._first()
        if self.log_probs.shape[1] == 0:
            return torch.zeros(pos.shape, device=pos.device)
        return torch.gather(self.log_probs.to(pos.device), 1, pos)

    def old_step_means(self, idx: torch.Tensor, k: int) -> torch.Tensor:
        """``[b, ...]``: the old policy's step mean at samples ``idx``' k-th trained step (``old_means``)."""
        if self.old_means is None:
            raise ValueError(
                "Trajectory.old_means is not set: the algorithm reads the old policy's step means, which collect.py "
                "stores when Algorithm.inputs() declares old_means; fix: declare them there"
            )
        return self.old_means[idx, k]

    def rollout_means(self) -> torch.Tensor:
        """``[B, T, ...]``: the rollout's step mean of each trained step (kept by ``rollout(keep_means=True)``)."""
        if self.means is None:
            raise ValueError("the rollout kept no step means; fix: rollout(..., keep_means=True)")
        pos = self.steps() - self._first()
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None]
        return self.means[rows, pos]

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """The trajectories of a batch's consecutive chunks as the batch's one (``denoise_in_chunks``)."""
        first = parts[0]

        def joined(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return Trajectory(
            latents=torch.cat([p.latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            window_start=min(p.window_start for p in parts),
            final=torch.cat([p.final for p in parts]),
            train_steps=joined("train_steps"),
            host_steps=first.host_steps,
            starts=joined("starts"),
            means=joined("means"),
            noise_seed=first.noise_seed,
        )
