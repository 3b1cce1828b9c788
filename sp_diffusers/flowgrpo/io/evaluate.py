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

from ...parallel.ledger import comm_phase
from ..sampling.guidance import paired
from ..sampling.rollout import velocity
from ..sampling.sde import ode_step
from .data import PromptRow
from .media import save_pixels

__all__ = ["Evaluator", "latent_preview", "ode_sample"]


@torch.no_grad()
def ode_sample(
    engine: Any,
    adapter: Any,
    cond: dict[str, Any],
    noise: torch.Tensor,
    schedule: Any,
    cfg_scale: float,
    cfg_batch: bool = True,
    hold: Callable[[Any], Any] = lambda engine: engine,
) -> torch.Tensor:
    """``noise`` denoised from sigma 1 to 0 with deterministic Euler steps on ``schedule``: the final latents.
    ``hold``: each step's engine passes through it (``guidance.WeightHolder``: weights gathered once)."""
    x = noise.float()
    if cfg_scale > 1.0 and cfg_batch:
        cond = {**cond, "cfg_pair": paired(cond)}  # stacked once, read by every step
    for i in range(schedule.num_steps):
        step_engine = hold(engine.for_step(i) if hasattr(engine, "for_step") else engine)
        t = schedule.timesteps[i].to(x.device)
        v = velocity(step_engine, adapter, x, t, cond, cfg_scale, cfg_batch=cfg_batch)
        x = ode_step(x, v, float(schedule.sigmas[i]), float(schedule.sigmas[i + 1]))
    if hasattr(adapter, "final_latents"):  # Wan2.2 TI2V: the first frame is the image's
        x = adapter.final_latents(x, cond)
    return x


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
    """Eval metrics and sample grids for a ``FlowGRPOTrainer`` (its engine, adapter, text encoder, rewards)."""

    def __init__(self, trainer: Any, eval_rows: list[PromptRow], sample_rows: list[PromptRow]) -> None:
        self.t, self.eval_rows, self.sample_rows = trainer, list(eval_rows), list(sample_rows)

    def noise(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_noise_seed(self.t.config.train.seed, index))
        return torch.randn(self.t.adapter.latent_shape(1), generator=g)

    def render(self, rows: list[PromptRow], indices: list[int]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The final latents of ``rows`` (noise of ``indices``), in micro-batches; and, for an image-conditioned
        family, ``{"source_pixels": [n, N, 3, H, W]}`` (what its rewards read), else ``{}``."""
        size = self.t.config.flowgrpo.micro_batch_size
        with self.t.weight_holder() as hold:  # gathered once for every micro-batch's steps
            parts = [
                self._render_part(rows[lo : lo + size], indices[lo : lo + size], hold) for lo in range(0, len(rows), size)
            ]
        sources = [p[1] for p in parts if p[1] is not None]  # an image-conditioned family's source pixels
        return torch.cat([p[0] for p in parts]), ({"source_pixels": torch.cat(sources)} if sources else {})

    def _render_part(
        self, rows: list[PromptRow], indices: list[int], hold: Callable[[Any], Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, g = self.t, self.t.config.flowgrpo
        prompts = [r.prompt for r in rows]
        batch: dict[str, Any] = {
            **t.encode_rows(rows, prompts),
            "latents": torch.cat([self.noise(i) for i in indices]),
        }
        if g.cfg_scale > 1.0 and t.conditioner is None:
            batch.update(t.text_encoder.encode_batch([""] * len(prompts), prefix="negative_"))
        batch = t.engine.prepare_batch(batch)
        with t.engine.eval_mode(), comm_phase("eval"):
            cond, noise = t._cond(batch), batch["latents"]
            final = ode_sample(t.engine, t.adapter, cond, noise, t.schedule, g.cfg_scale, t.config.rollout.cfg_batch, hold)
        return final, batch.get("source_pixels")

    def evaluate(self) -> dict[str, float]:
        """Every eval prompt once (ODE, fixed noise), scored: the mean total reward and each reward's mean."""
        t = self.t
        n, dp, rank = len(self.eval_rows), t.engine.dp_size, t.engine.dp_rank
        per = math.ceil(n / dp)
        mine = list(range(rank * per, min(n, (rank + 1) * per)))
        valid = len(mine)
        mine += [mine[-1] if mine else 0] * (per - valid)  # repeats keep every rank's forwards in step
        rows = [self.eval_rows[i] for i in mine]
        with t.engine.ema_weights():  # the moving average where flowgrpo.ema keeps one
            final, sources = self.render(rows, mine)
        batch = {"prompts": [r.prompt for r in rows], "metadata": [r.metadata for r in rows], **sources}
        total, parts = t.score(final, batch)
        table = torch.stack([total, *parts.values(), torch.arange(per) < valid], dim=1).float()
        table = t._gather_dp(table)
        table = table[table[:, -1] > 0.5]
        metrics = {"eval_reward_mean": table[:, 0].mean().item(), "eval_reward_std": table[:, 0].std(correction=0).item()}
        if len(parts) > 1 or (parts and t.config.flowgrpo.rewards):
            metrics.update({f"eval/{name}": table[:, 1 + j].mean().item() for j, name in enumerate(parts)})
        return metrics

    def write_samples(self, iteration: int) -> Path | None:
        """Render the sample prompts (every rank, the same work) and write the grid on rank 0; its path there."""
        t = self.t
        count = min(t.config.train.sample_count, len(self.sample_rows))
        with t.engine.ema_weights():
            final, _ = self.render(self.sample_rows[:count], list(range(count)))
        if t.rank != 0:
            return None
        decoder = getattr(t, "decoder", None)
        pixels = decoder(final) if decoder is not None else latent_preview(t.adapter, final)
        return save_pixels(pixels.cpu(), t.out_dir / "samples" / f"iteration-{iteration:08d}")
