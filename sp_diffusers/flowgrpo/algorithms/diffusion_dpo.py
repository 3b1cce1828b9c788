"""Diffusion-DPO (Wallace et al., arXiv 2311.12908) in its flow-matching form as verl-omni trains it (``DPOLoss``
and ``sample_noise_and_timesteps``): online on pairs of the policy's own samples, or offline on a preference data
set (``flowgrpo.dpo.pairs``: the trainer takes the pairs' encoded images where a rollout would be, io/preferences.py).

Collect: the trained policy samples every step deterministically (Euler, the run's guidance); the final data ``x0``
is kept and scored. Each prompt group gives one pair: its highest reward is chosen (``w``), its lowest rejected
(``l``); among equal rewards the first of the highest and the last of the lowest, as the reference's stable sort
picks them. The group's other samples are not trained.

Train: a pair shares one point of the forward process, its noise ``eps`` and its noise level ``sigma``, the
scheduler's training grid at index ``floor(1000 u)``, ``u = sigmoid(N(0, 1))`` (the logit-normal timesteps):

    x_t = (1 - sigma) x0 + sigma eps          target u = eps - x0
    err_m(x0) = mean over the latent's elements of (v_m(x_t) - u)^2     m: the policy, the reference (adapters off)
    inside = -beta / 2 [(err_theta(w) - err_ref(w)) - (err_theta(l) - err_ref(l))]
    loss = -mean over pairs of log sigmoid(inside)

``-beta / 2 (err_theta - err_ref)`` is each image's implicit reward; their difference (``inside``) the pair's margin.

The pairs are the update's units: ``kept`` lays them out chosen, rejected, chosen, ...; the update shuffles and cuts
whole pairs (``pair_units``), so a micro-batch holds both halves of each of its pairs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ...parallel.devices import to_device
from ..batch import IterationBatch, StepPlan
from ..config import ConfigError, TrainConfig
from ..sampling.denoise import Span
from ..sampling.trajectory import Trajectory
from .base import Algorithm, Inputs, StepInputs, Targets
from .old_policy import OldPolicy

__all__ = ["DiffusionDPO", "check_pair_family", "dpo_loss", "logit_normal_index", "online_pairs"]

PAIR_KINDS = ("qwenimage", "flux", "flux2", "sd3", "wan", "zimage")  # the families whose offline pairs are read (wan: videos)
LOGIT_MEAN, LOGIT_STD = 0.0, 1.0  # the reference's logit-normal timestep density (fixed there too)


def check_pair_family(config: TrainConfig) -> None:
    """Offline pairs are images or videos of a family whose VAE the trainer encodes with (``model.kind`` settled)."""
    g = config.flowgrpo
    if (g.dpo.pairs or g.dpo.eval_pairs) and config.model.kind not in PAIR_KINDS:
        raise ConfigError(
            f"flowgrpo.dpo.pairs with model.kind={config.model.kind}: offline pairs are read for "
            f"{', '.join(PAIR_KINDS)}; fix: online Diffusion-DPO (flowgrpo.dpo.pairs empty)"
        )


def online_pairs(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen, rejected)`` host indices, one pair per prompt group of two or more samples, in the order the
    groups first appear: the highest reward (the first such sample) and the lowest (the last such sample)."""
    r = rewards.detach().cpu().double()
    g = groups.detach().cpu()
    chosen, rejected = [], []
    seen: dict[int, list[int]] = {}
    for i, gid in enumerate(g.tolist()):
        seen.setdefault(gid, []).append(i)
    for members in seen.values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda i: float(r[i]), reverse=True)  # stable: ties keep their order
        chosen.append(ordered[0])
        rejected.append(ordered[-1])
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def logit_normal_index(z: torch.Tensor, grid: int) -> torch.Tensor:
    """Indices into a training grid of ``grid`` sigmas (the scheduler's ``num_train_timesteps``) at
    ``floor(grid sigmoid(z))`` for standard-normal draws ``z``: the reference's logit-normal timesteps."""
    u = torch.sigmoid(LOGIT_MEAN + LOGIT_STD * z)
    return (u * grid).long().clamp_max(grid - 1)


def dpo_loss(
    v: torch.Tensor,
    v_ref: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    *,
    beta: float,
    normalizer: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Diffusion-DPO loss of ``b`` samples laid out chosen, rejected, chosen, ... (module docstring), divided by
    ``normalizer``. ``v`` ``[b, ...]`` carries the gradient; ``v_ref`` is detached; the errors are computed in
    float32 at least, as the reference's ``.float()``. Metrics (detached, 0-d): ``loss`` (before the normalizer),
    ``implicit_acc`` (the fraction of pairs whose margin is > 0), ``implicit_reward_chosen`` / ``_rejected`` /
    ``implicit_reward_margin`` (means over the pairs; verl-omni's rewards/chosen, rejected, margins)."""
    if v.shape != x0.shape or v_ref.shape != x0.shape or noise.shape != x0.shape:
        raise ValueError(
            f"dpo_loss: v {tuple(v.shape)}, v_ref {tuple(v_ref.shape)}, noise {tuple(noise.shape)} must all have "
            f"x0's shape {tuple(x0.shape)}"
        )
    if x0.shape[0] < 2 or x0.shape[0] % 2:
        raise ValueError(
            f"dpo_loss: {x0.shape[0]} samples; Diffusion-DPO reads pairs laid out chosen, rejected, chosen, ...: pass "
            "an even number (flowgrpo.micro_batch_size even)"
        )
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"dpo_loss: beta={beta!r} must be a finite number > 0 (flowgrpo.dpo.beta)")
    dtype = torch.promote_types(v.dtype, torch.float32)
    target = noise.to(dtype) - x0.to(dtype)
    model_err = ((v.to(dtype) - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((v_ref.detach().to(dtype) - target) ** 2).flatten(1).mean(dim=1)
    w_diff = model_err[0::2] - ref_err[0::2]
    l_diff = model_err[1::2] - ref_err[1::2]
    inside = -0.5 * beta * (w_diff - l_diff)
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        chosen, rejected = -0.5 * beta * w_diff, -0.5 * beta * l_diff
        metrics = {
            "loss": loss.detach(),
            "implicit_acc": (inside > 0).to(dtype).mean(),
            "implicit_reward_chosen": chosen.mean(),
            "implicit_reward_rejected": rejected.mean(),
            "implicit_reward_margin": (chosen - rejected).mean(),
            "model_error": model_err.mean(),
            "reference_error": ref_err.mean(),
        }
    return loss / normalizer, metrics


def _point_seed(seed: int, k: int) -> int:
    return (int(seed) * 2862933555777941757 + 3037000493 * (k + 1)) % (2**63 - 1)


class DiffusionDPO(Algorithm):
    name = "diffusion_dpo"
    section = "dpo"
    pair_units = True
    # a deterministic rollout, one forward-process point per pair, no ratio, no advantage normalisation
    ignores = (
        "window_size",
        "window_range",
        "per_sample_windows",
        "sde_steps",
        "sde_type",
        "noise_level",
        "timestep_fraction",
        "clip_range",
        "adv_clip_max",
        "kl_coef",
        "drop_zero_advantage",
        "recompute_old_log_probs",
    )

    def __init__(self, config: TrainConfig) -> None:
        super().__init__(config)
        self.frozen: OldPolicy | None = None  # full fine-tuning: the initial weights, kept as the reference

    @classmethod
    def ignored(cls, config: TrainConfig) -> tuple[str, ...]:
        # offline: no rollout, so no prompt groups
        return cls.ignores + (("group_size",) if config.flowgrpo.dpo.pairs else ())

    @classmethod
    def check(cls, config: TrainConfig) -> None:
        g = config.flowgrpo
        beta = g.dpo.beta
        if isinstance(beta, bool) or not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            raise ConfigError(
                f"flowgrpo.dpo.beta={beta!r} must be a finite number > 0 (verl-omni's default 2000; its online "
                "Qwen-Image recipe 100)"
            )
        if (g.dpo.pairs or g.dpo.eval_pairs) and not config.model.pipeline:
            key = "flowgrpo.dpo.pairs" if g.dpo.pairs else "flowgrpo.dpo.eval_pairs"
            raise ConfigError(
                f"{key}: the pairs' images are encoded through the pipeline's VAE, and model.pipeline is empty; fix: "
                "model.pipeline=<the diffusers pipeline folder of this model>"
            )
        if config.model.kind:  # else settled from model.pipeline later, and checked then (the trainer)
            check_pair_family(config)
        if g.dpo.pairs and config.data.train:
            raise ConfigError(
                "flowgrpo.dpo.pairs and data.train are both set: offline Diffusion-DPO trains the pairs' prompts and "
                "samples none; fix: one of them"
            )
        if g.group_size < 2 and not g.dpo.pairs:
            raise ConfigError(
                f"flowgrpo.group_size={g.group_size}: Diffusion-DPO pairs the best and the worst of a prompt's "
                "samples; fix: flowgrpo.group_size >= 2 (verl-omni's recipe: 16)"
            )
        if g.micro_batch_size % 2:
            raise ConfigError(
                f"flowgrpo.micro_batch_size={g.micro_batch_size}: Diffusion-DPO trains (chosen, rejected) pairs "
                "whole, so a micro-batch holds an even number of samples; fix: an even micro_batch_size"
            )
        if g.mini_batches > g.prompts_per_rank:
            raise ConfigError(
                f"flowgrpo.mini_batches={g.mini_batches} > flowgrpo.prompts_per_rank={g.prompts_per_rank}: each "
                "prompt gives one pair, and each optimizer step needs one; fix: mini_batches <= prompts_per_rank"
            )

    # ---------------------------------------------------------------------------------------- lifecycle
    def attach(self, engine: Any) -> None:
        """Full fine-tuning: copy the weights the run starts from into a frozen twin, the reference, once (the first
        call: the trainer attaches before it loads a checkpoint, so a resumed run keeps the base model as its
        reference too). With LoRA the reference is the trained model with its adapters off: nothing kept."""
        if engine.lora is not None or self.frozen is not None:
            return
        if engine.num_experts > 1:
            raise ConfigError(
                "flowgrpo.algorithm=diffusion_dpo with full fine-tuning keeps a frozen reference of one model, and "
                "this model has two experts; fix: lora.enabled=true (the reference is the adapters-off model)"
            )
        self.frozen = OldPolicy(engine)

    @contextlib.contextmanager
    def reference_policy(self, engine: Any) -> Iterator[Any]:
        if self.frozen is None:
            with super().reference_policy(engine) as reference:
                yield reference
        else:
            yield self.frozen.engine

    # ------------------------------------------------------------------------------------------ batch
    def plan(self, batch: IterationBatch, gen: torch.Generator, iteration: int, shared: torch.Generator) -> None:
        # one trained point per sample (its sigma drawn below, per pair); the forward process's seed
        batch.plan.window_start = 0
        batch.plan.train_steps = torch.zeros(len(batch), 1, dtype=torch.long)
        batch.plan.noise_seed = int(torch.randint(2**62, (1,), generator=gen))

    # ---------------------------------------------------------------------------------------- rollout
    def span(self, plan: StepPlan, schedule: Any) -> Span:
        return Span(0, 0)  # every step deterministic (Euler)

    # -------------------------------------------------------------------------------------- advantages
    def advantages(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """The pairs' labels: +1 chosen, -1 rejected, 0 the group's other samples (:func:`online_pairs`)."""
        chosen, rejected = online_pairs(rewards, groups)
        labels = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
        labels[chosen], labels[rejected] = 1.0, -1.0
        return to_device(labels, rewards.device)

    def kept(self, per_sample_all: torch.Tensor, dp_rank: int, dp_size: int, seed: int) -> torch.Tensor:
        """This rank's pairs, chosen then rejected, in group order (every rank has ``prompts_per_rank`` of them)."""
        labels = per_sample_all.detach().cpu().reshape(dp_size, -1)[dp_rank]
        # a rank's prompt groups are contiguous, one chosen and one rejected each: the i-th of both share a group
        chosen, rejected = torch.nonzero(labels > 0).flatten(), torch.nonzero(labels < 0).flatten()
        return torch.stack([chosen, rejected], dim=1).flatten()

    # ----------------------------------------------------------------------------------------- update
    def inputs(self) -> Inputs:
        """The policy's and the reference's velocities at each pair's noised data; no log-probs."""
        return Inputs(evaluation="forward_process", old_log_probs=False, reference=True)

    def forward_point(
        self, traj: Trajectory, k: int, idx: torch.Tensor, schedule: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One noise and one sigma per pair: drawn for the whole batch on the host from the batch's seed and read at
        each pair's chosen sample (``idx`` is laid out chosen, rejected, ...), so that every SP rank and any
        micro-batching draws the same; queued to the device (no host sync)."""
        if schedule.train_sigmas is None:
            raise ValueError("Diffusion-DPO needs the scheduler's training grid (Schedule.train_sigmas)")
        final = traj.final
        gen = torch.Generator().manual_seed(_point_seed(traj.noise_seed, k))
        z = torch.randn(final.shape[0], generator=gen, dtype=torch.float32)
        eps = torch.randn(final.shape, generator=gen, dtype=torch.float32)
        rows = idx[0::2].repeat_interleave(2)  # each pair reads its chosen sample's draws
        index = to_device(logit_normal_index(z, schedule.train_sigmas.numel()), final.device)[rows]
        sigma = schedule.train_sigmas[index]
        return sigma, sigma * 1000.0, to_device(eps, final.device)[rows].to(final.dtype)

    def loss(
        self, step: StepInputs, targets: Targets, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`dpo_loss` of the micro-batch's pairs."""
        assert step.v is not None and step.v_ref is not None and step.x0 is not None and step.noise is not None
        return dpo_loss(step.v, step.v_ref, step.x0, step.noise, beta=self.g.dpo.beta, normalizer=normalizer)
