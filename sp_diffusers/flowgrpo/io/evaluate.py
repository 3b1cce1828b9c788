"""Deterministic evaluation (``train.eval_every``) and sample grids (``train.sample_every``) during training.

Evaluation samples every eval prompt once with the ODE (no SDE noise anywhere) from a fixed noise per prompt (seeded
by ``train.seed`` and the prompt's index, so every evaluation of a run, and every layout, starts from the same
noise), and scores the results with the run's rewards. The eval prompts are split over the data-parallel ranks; a
rank with fewer pads with repeats (dropped from the metrics) so that every rank runs the same number of forwards,
as FSDP's collectives need. Metrics: ``eval_reward_mean``, ``eval_reward_std`` and ``eval/<name>`` per configured
reward.

Sample grids render the first ``train.sample_count`` sample prompts (the eval prompts, else the training file's
first rows, else the built-in prompts) the same way on every rank, and rank 0 writes ``<out_dir>/samples/
iteration-N.png`` (video: ``.mp4``, ``.gif`` without a video writer), decoded by the pipeline's VAE, or, without
one, as a false-colour preview of the latents' first three channels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...engine.protocols import TrainingEngine
from ...parallel.ledger import comm_phase
from ..batch import agreed_count_groups
from ..models.conditioning import PromptEncoder
from ..models.prompt_cache import cat_padded
from ..rewards.scoring import Scorer
from ..sampling.denoise import Sampler, denoise
from .data import PromptRow
from .media import save_pixels, save_video

__all__ = ["Evaluator", "latent_preview"]


def latent_preview(adapter: Any, latents: torch.Tensor) -> torch.Tensor:
    """Without a VAE: the first three latent channels, scaled to [0, 1] per sample, in the pixels' layout."""
    z = adapter.vae_latents(latents).float()
    z = z[:, :3] if z.shape[1] >= 3 else z[:, :1].expand(-1, 3, *z.shape[2:])
    flat = z.flatten(1)
    lo, hi = flat.min(dim=1).values, flat.max(dim=1).values
    shape = (-1,) + (1,) * (z.ndim - 1)
    return adapter.pixel_layout((z - lo.view(shape)) / (hi - lo).clamp_min(1e-6).view(shape))


def _noise_seed(seed: int, index: int) -> int:
    return (int(seed) * 2_654_435_761 + int(index) * 97 + 0xE7A1) % (2**63 - 1)


class Evaluator:
    """Eval metrics and sample grids of a run: its engine, adapter and schedule, the prompts' conditioning, the
    rewards, where a rollout's weights live (``weights()``: a ``guidance.WeightHolder``), the VAE (None: a latent
    preview)."""

    def __init__(
        self,
        *,
        config: Any,
        engine: TrainingEngine,
        adapter: Any,
        schedule: Any,
        prompts: PromptEncoder,
        scorer: Scorer,
        weights: Callable[[], Any],
        decoder: Callable[[torch.Tensor], torch.Tensor] | None,
        rank: int,
        audio_decoder: Any = None,
        out_dir: Path,
        eval_rows: list[PromptRow],
        sample_rows: list[PromptRow],
    ) -> None:
        self.config, self.engine, self.adapter, self.schedule = config, engine, adapter, schedule
        self.prompts, self.scorer, self.weights, self.decoder = prompts, scorer, weights, decoder
        self.audio_decoder = audio_decoder  # LTX-2's soundtracks (models/ltx2.AudioDecoder): WAVs beside the grid
        self.rank, self.out_dir = rank, Path(out_dir)
        self.eval_rows, self.sample_rows = list(eval_rows), list(sample_rows)

    def noise(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_noise_seed(self.config.train.seed, index))
        return torch.randn(self.adapter.latent_shape(1), generator=g)

    def render(self, rows: list[PromptRow], indices: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final latents of ``rows`` (noise of ``indices``), in micro-batches; and, for an image-conditioned
        family, the rows' source pixels ``[n, N, 3, H, W]`` (what its rewards read), else None."""
        size = self.config.flowgrpo.micro_batch_size
        with self.weights() as hold:  # gathered once for every micro-batch's steps
            parts = [
                self._render_part(rows[lo : lo + size], indices[lo : lo + size], hold)
                for lo in range(0, len(rows), size)
            ]
        sources = [p[1] for p in parts if p[1] is not None]
        return torch.cat([p[0] for p in parts]), (cat_padded(sources) if sources else None)

    def _render_part(
        self, rows: list[PromptRow], indices: list[int], hold: Callable[[Any], Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = self.config.flowgrpo
        cond, sources = self.prompts.encode(rows)
        tensors = {**cond, "latents": torch.cat([self.noise(i) for i in indices])}
        if sources is not None:
            tensors["source_pixels"] = sources
        tensors = agreed_count_groups(self.engine.prepare_batch(tensors), self.engine)
        noise, sources = tensors.pop("latents"), tensors.pop("source_pixels", None)
        with self.engine.eval_mode(), comm_phase("eval"):
            sampler = Sampler(self.engine, self.adapter, self.schedule, g.cfg_scale, self.config.rollout.cfg_batch, hold)
            final = denoise(sampler, tensors, noise).final
        return final, sources

    def evaluate(self) -> dict[str, float]:
        """Every eval prompt once (ODE, fixed noise), scored: the mean total reward and each reward's mean."""
        n, dp, rank = len(self.eval_rows), self.engine.dp_size, self.engine.dp_rank
        per = math.ceil(n / dp)
        mine = list(range(rank * per, min(n, (rank + 1) * per)))
        valid = len(mine)
        mine += [mine[-1] if mine else 0] * (per - valid)  # repeats keep every rank's forwards in step
        rows = [self.eval_rows[i] for i in mine]
        with self.engine.ema_weights():  # the moving average where flowgrpo.ema keeps one
            final, sources = self.render(rows, mine)
        scores = self.scorer(final, [r.prompt for r in rows], [r.metadata for r in rows], sources, features=False)
        parts = scores.each
        table = torch.stack([scores.total, *parts.values(), torch.arange(per) < valid], dim=1).float()
        table = self.engine.gather_dp(table)
        table = table[table[:, -1] > 0.5]
        metrics = {
            "eval_reward_mean": table[:, 0].mean().item(),
            "eval_reward_std": table[:, 0].std(correction=0).item(),
        }
        if len(parts) > 1 or (parts and self.config.flowgrpo.rewards):
            metrics.update({f"eval/{name}": table[:, 1 + j].mean().item() for j, name in enumerate(parts)})
        return metrics

    def write_samples(self, iteration: int) -> Path | None:
        """Render the sample prompts (every rank, the same work) and write the grid on rank 0; its path there."""
        count = min(self.config.train.sample_count, len(self.sample_rows))
        with self.engine.ema_weights():
            final, _ = self.render(self.sample_rows[:count], list(range(count)))
        if self.rank != 0:
            return None
        stem = self.out_dir / "samples" / f"iteration-{iteration:08d}"
        if self.decoder is not None and self.audio_decoder is not None:
            waves, rate = self.audio_decoder(final).cpu(), self.audio_decoder.sample_rate
            fps = self.config.model.frame_rate
            return save_video(self.decoder(final).cpu(), stem.with_suffix(".mp4"), fps, waves, rate)
        pixels = self.decoder(final) if self.decoder is not None else latent_preview(self.adapter, final)
        return save_pixels(pixels.cpu(), stem)
