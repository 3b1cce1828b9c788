"""DiffusionNFT (arXiv 2509.16117; NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``; verl-omni's
``DiffusionNFTLoss``): online RL on the forward process. No stochastic step, no likelihood, no ratio.

Collect: the OLD policy samples every step deterministically, without CFG (``flowgrpo.nft.solver``: the
reference's ``dpm2`` or Euler), and only the final data ``x0`` is kept. Rewards become optimality probabilities:

    A = (R - mean_prompt(R)) / (std_batch(R) + 1e-4)             (population std of every dp rank's rewards)
    r = clamp(clip(A, -C, C) / C / 2 + 1/2, 0, 1)                 C = flowgrpo.adv_clip_max (5)

Train: each sample on its own random ``int(N * flowgrpo.nft.timestep_fraction)`` of the N schedule steps, each
with fresh noise, ``t`` the step's sigma (the reference's ``timestep / 1000``):

    x_t = (1 - t) x0 + t eps;   v = v_theta(x_t),  v_old (old policy, no grad),  v_ref (adapters off, no grad)
    v+  = beta v + (1 - beta) v_old            v-  = (1 + beta) v_old - beta v       (beta = flowgrpo.nft.beta)
    x0+- = x_t - t v+-,   w+- = stopgrad(mean |x0+- - x0|) clamped >= 1e-5,   L+- = mean((x0+- - x0)^2) / w+-
    loss = mean_batch(C (r L+ + (1 - r) L-) / beta) + kl_coef * mean((v - v_ref)^2)

After the iteration's optimizer steps the old policy moves toward the trained one:
``old <- d old + (1 - d) theta``, ``d = old_policy.old_policy_decay(optimizer step, flowgrpo.nft.decay)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...parallel.devices import to_device
from ..batch import IterationBatch, StepPlan
from ..config import ConfigError, TrainConfig
from ..sampling.denoise import Span
from ..sampling.dpm_solver import DPMSolver2
from ..sampling.trajectory import Trajectory
from .base import Algorithm, Inputs, StepInputs, Targets
from .old_policy import DECAY_SCHEDULES, OldPolicy, old_policy_decay

__all__ = ["NFT_SOLVERS", "DiffusionNFT", "nft_loss", "reward_prob"]

NFT_SOLVERS = ("dpm2", "euler")
WEIGHT_MIN = 1e-5  # the adaptive weights' floor (the reference's clip(min=0.00001))


def reward_prob(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """The optimality probability ``r = clamp(clip(A, -C, C) / C / 2 + 1/2, 0, 1)`` of each advantage."""
    a = advantages.clamp(-clip, clip)
    return (a / clip / 2.0 + 0.5).clamp(0.0, 1.0)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    clip: float,
    kl_coef: float = 0.0,
    v_ref: torch.Tensor | None = None,
    normalizer: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of one trained step of ``b`` samples (module docstring), divided by ``normalizer``.

    ``v_theta`` ``[b, ...]`` carries the gradient; ``v_old``, ``v_ref`` (needed when ``kl_coef > 0``) are
    detached; ``t`` and ``r`` are ``[b]``. The adaptive weights are computed in fp64 and the squared errors divided
    by them in fp64, as the reference does (its ``weight_factor`` is a double tensor). Metrics (detached, 0-d) are
    named as the reference logs them: ``policy_loss`` (``mean(C (r L+ + (1 - r) L-) / beta)``),
    ``unweighted_policy_loss`` (the same without ``C``), ``kl_div`` (= ``kl_div_loss`` = ``kl``, 0 without a
    reference), ``old_kl_div``, ``old_deviate`` / ``_max`` (``(v - v_old)^2``), ``x0_norm`` / ``_max``, and
    verl-omni's ``positive_loss``, ``negative_loss``, ``reward_prob_mean``; ``loss`` = ``total_loss`` before the
    normalizer."""
    if v_theta.shape != x0.shape or v_old.shape != x0.shape or x_t.shape != x0.shape:
        raise ValueError(
            f"nft_loss: v_theta {tuple(v_theta.shape)}, v_old {tuple(v_old.shape)}, x_t {tuple(x_t.shape)} must all "
            f"have x0's shape {tuple(x0.shape)}; pass the velocities of x_t"
        )
    if t.shape != (x0.shape[0],) or r.shape != t.shape:
        raise ValueError(f"nft_loss: t {tuple(t.shape)} and r {tuple(r.shape)} must be [b] = [{x0.shape[0]}]")
    if not beta > 0:
        raise ValueError(f"nft_loss: beta={beta!r} must be > 0 (flowgrpo.nft.beta; the reference uses 1.0 or 0.1)")
    if kl_coef > 0 and v_ref is None:
        raise ValueError("nft_loss: kl_coef > 0 needs v_ref (the adapters-off velocity); pass it or kl_coef=0")
    dims = tuple(range(1, x0.ndim))
    tt = t.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    v_old = v_old.detach()
    positive = beta * v_theta + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v_theta
    x0_pos, x0_neg = x_t - tt * positive, x_t - tt * negative
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(WEIGHT_MIN)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp_min(WEIGHT_MIN)
    loss_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
    loss_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)
    rr = r.detach().to(loss_pos.dtype)
    unweighted = rr * loss_pos / beta + (1.0 - rr) * loss_neg / beta
    policy = (unweighted * clip).mean()
    if kl_coef > 0:
        kl = ((v_theta - v_ref.detach()) ** 2).mean(dim=dims).mean()
        total = policy + kl_coef * kl
    else:
        kl = policy.new_zeros(())
        total = policy
    with torch.no_grad():
        deviate = (v_theta.detach() - v_old) ** 2
        metrics = {
            "loss": total.detach(),
            "total_loss": total.detach(),
            "policy_loss": policy.detach(),
            "unweighted_policy_loss": unweighted.mean().detach(),
            "positive_loss": loss_pos.mean().detach(),
            "negative_loss": loss_neg.mean().detach(),
            "reward_prob_mean": rr.mean(),
            "kl": kl.detach(),
            "kl_div": kl.detach(),
            "kl_div_loss": kl.detach(),
            "old_deviate": deviate.mean(),
            "old_deviate_max": deviate.max(),
            "x0_norm": (x0**2).mean(),
            "x0_norm_max": (x0**2).max(),
        }
        if v_ref is not None:
            metrics["old_kl_div"] = ((v_old - v_ref.detach()) ** 2).mean()
    return total / normalizer, metrics


def _step_seed(seed: int, k: int) -> int:
    return (int(seed) * 6364136223846793005 + 1442695040888963407 * (k + 1)) % (2**63 - 1)


class DiffusionNFT(Algorithm):
    name = "diffusion_nft"
    section = "nft"
    # a deterministic rollout, trained on the forward process (nft.timestep_fraction), no ratio to clip
    ignores = ("window_size", "window_range", "per_sample_windows", "sde_steps", "timestep_fraction", "clip_range")

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.old: OldPolicy | None = None

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        if not (isinstance(g.nft.beta, (int, float)) and math.isfinite(g.nft.beta) and g.nft.beta > 0):
            raise ConfigError(
                f"flowgrpo.nft.beta={g.nft.beta!r} must be a finite number > 0 (DiffusionNFT uses 1.0; 0.1 for OCR "
                "and multi-reward)"
            )
        if g.nft.decay not in DECAY_SCHEDULES:
            raise ConfigError(
                f"flowgrpo.nft.decay={g.nft.decay!r}: choose one of {', '.join(DECAY_SCHEDULES)} (DiffusionNFT's "
                "decay_type 0, 1, 2; its default is linear_to_0_5, delayed_linear_to_0_999 for OCR)"
            )
        if g.nft.solver not in NFT_SOLVERS:
            raise ConfigError(
                f"flowgrpo.nft.solver={g.nft.solver!r}: choose 'dpm2' (DiffusionNFT's 2nd-order DPM-Solver on the "
                "predicted data) or 'euler'"
            )
        if not (0 < g.nft.timestep_fraction <= 1) or int(g.num_steps * g.nft.timestep_fraction) < 1:
            raise ConfigError(
                f"flowgrpo.nft.timestep_fraction={g.nft.timestep_fraction!r} x flowgrpo.num_steps={g.num_steps} "
                "must train at least one step, with the fraction in (0, 1]; DiffusionNFT uses 0.99"
            )
        if g.cfg_scale != 1.0:
            raise ConfigError(
                f"flowgrpo.cfg_scale={g.cfg_scale!r}: DiffusionNFT samples and trains without classifier-free "
                "guidance (it trains the guided policy itself); fix: flowgrpo.cfg_scale=1.0"
            )
        if not g.adv_clip_max > 0:
            raise ConfigError(
                f"flowgrpo.adv_clip_max={g.adv_clip_max!r} is DiffusionNFT's C (r = clip(A, -C, C) / C / 2 + 1/2): it "
                "must be > 0; the reference uses 5"
            )

    # ---------------------------------------------------------------------------------------- lifecycle
    def attach(self, engine: Any) -> None:
        if engine.num_experts > 1:
            raise ConfigError(
                "flowgrpo.algorithm='diffusion_nft' does not train a two-expert model yet (its old policy is one "
                "engine); fix: model.pipeline with one transformer, or flowgrpo.algorithm=flow_grpo"
            )
        if self.old is None:
            self.old = OldPolicy(engine)  # a copy of the trained weights, as the reference starts
        else:
            self.old.copy()  # after a checkpoint load: old = theta, as the reference's resume loads one LoRA twice

    def after_update(self, engine: Any, metrics: dict[str, float]) -> dict[str, float]:
        decay = old_policy_decay(engine.global_step, self.g.nft.decay)
        self._old().blend(decay)
        return {"old_policy_decay": decay}

    def _old(self) -> OldPolicy:
        if self.old is None:
            raise RuntimeError("DiffusionNFT has no old policy: call attach(engine) first (the trainer does)")
        return self.old

    # ------------------------------------------------------------------------------------------ batch
    def _count(self) -> int:
        return int(self.g.num_steps * self.g.nft.timestep_fraction)

    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        # per sample a random subset (a permutation's first T) of the N schedule steps, as the reference's perms_time
        n, count = self.g.num_steps, self._count()
        batch.plan.window_start = 0
        batch.plan.train_steps = torch.stack([torch.randperm(n, generator=gen)[:count] for _ in range(len(batch))])
        batch.plan.noise_seed = int(torch.randint(2**62, (1,), generator=gen))

    # ---------------------------------------------------------------------------------------- rollout
    def span(self, plan: StepPlan, schedule: Any) -> Span:
        # every step deterministic, by a fresh solver per rollout (dpm2 keeps the previous step's prediction)
        return Span(0, 0, solver=DPMSolver2() if self.g.nft.solver == "dpm2" else None)

    def rollout_engine(self, engine: Any) -> Any:
        return self._old().engine

    def drops_zero_advantage(self) -> bool:
        return False  # r = 1/2 still trains (and regularises toward the old policy): the reference keeps every sample

    # ----------------------------------------------------------------------------------------- update
    def inputs(self) -> Inputs:
        """The velocities at the final data noised to each trained step's sigma: the policy's, the old policy's
        (the rollout engine's) and, for the KL, the adapters-off one's; no log-probs."""
        return Inputs(
            evaluation="forward_process", old_log_probs=False, old_velocity=True, reference=self.g.kl_coef > 0
        )

    def forward_point(
        self, traj: Trajectory, k: int, idx: torch.Tensor, schedule: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k-th trained schedule step's sigma and timestep, and fresh noise: drawn for the whole batch on the
        host from (the batch's seed, k), so that every rank of an SP group, and any micro-batching, draws the same;
        queued to the device (no host sync)."""
        steps = traj.steps()[idx, k]
        final = traj.final
        gen = torch.Generator().manual_seed(_step_seed(traj.noise_seed, k))
        eps = torch.randn(final.shape, generator=gen, dtype=torch.float32)
        return schedule.sigmas[steps], schedule.timesteps[steps], to_device(eps, final.device)[idx].to(final.dtype)

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`nft_loss` of one trained step."""
        g = self.g
        assert step.x0 is not None and step.v is not None and step.v_old is not None
        r = reward_prob(targets.advantages.to(step.x0.dtype), g.adv_clip_max)
        return nft_loss(
            step.v, step.v_old, step.x0, step.x_t, step.t, r, beta=g.nft.beta, clip=g.adv_clip_max,
            kl_coef=g.kl_coef, v_ref=step.v_ref, normalizer=normalizer,
        )
