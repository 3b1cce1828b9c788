"""The FlowGRPO loop on top of ``FSDPEngine``: rollout -> reward -> old log-probs -> advantages -> update.

``flowgrpo.algorithm`` picks the reference: ``flow_grpo`` (an SDE window of W steps at a random start, the rest
ODE, every window step trained; advantages over the batch std, population, + 1e-4) or ``dance_grpo`` (every step
SDE with DanceGRPO's step, each sample trains on its own random ``int((N - 1) * timestep_fraction)`` of steps
0..N-2, the last never; advantages over each group's unbiased std + 1e-8; the reward reads the last step's
predicted data). With ``flowgrpo.drop_zero_advantage`` only samples with a non-zero advantage are trained
(``selection.py``: the same count on every dp rank).

Data parallel ranks draw different prompts; the ranks of one SP group draw the same ones (every random
choice is seeded by (seed, iteration, dp rank), never by the global rank) and the engine broadcasts the
batch from the group's first rank anyway. Rank 0 writes ``metrics.jsonl`` (and TensorBoard when
installed), ``metrics.png`` and shows a tqdm bar; checkpoints go to ``<out_dir>/checkpoints`` and a
restarted run resumes from the newest one.

Building the parts from the config: ``build.py``; the policy update: ``update.py``; metrics: ``metrics.py``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..devices import collective_device, fetch_scalars, to_device
from ..engine import EngineSettings, FSDPEngine
from ..engine.checkpoint import find_latest
from ..launch import init_distributed
from .advantages import group_advantages
from .build import (
    build_model,
    build_text_encoder,
    check_algorithm,
    check_run,
    engine_settings,
    run_schedule,
    step_rule,
)
from .config import TrainConfig, validate
from .metrics import RunLog
from .models import build_adapter
from .rewards import Reward, build_reward
from .rollout import Trajectory, evaluate_window_step, rollout
from .run_lock import lock_run_dir
from .selection import kept_samples
from .text import DEFAULT_PROMPTS
from .update import policy_update

__all__ = ["FlowGRPOTrainer"]

EngineFactory = Callable[[torch.nn.Module, EngineSettings], FSDPEngine]


def _seed(*parts: int) -> int:
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value * 6364136223846793005 + int(p) + 1442695040888963407) % (2**63 - 1)
    return value


class FlowGRPOTrainer:
    """Builds model, text encoder, engine and reward from a ``TrainConfig`` and runs the loop."""

    def __init__(
        self,
        config: TrainConfig,
        reward: Reward | None = None,
        model: torch.nn.Module | None = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        """``engine_factory(model, settings)`` builds the engine (default ``FSDPEngine``; the verl integration
        passes one that builds it through verl's ``EngineRegistry``)."""
        validate(config)  # a config built in code gets the checks load_config gives a YAML one
        init_distributed()
        self.config = c = config
        check_algorithm(c)
        # FSDP2 warns when a wrapped model returns a view (Wan's unpatchify does); the warning is about in-place
        # ops on that view, and the trainer only ever reads the velocity (every op on it is out of place)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        model = model if model is not None else build_model(c)
        self.engine = (engine_factory or FSDPEngine)(model, engine_settings(c, model))
        self.text_encoder = build_text_encoder(c, self.engine.device)
        self.adapter = build_adapter(
            self.engine.model,
            c.model.image_size,
            pooled_from_encoder=bool(c.text.pipeline),
            frames=c.model.frames,
            text_len=c.text.max_sequence_length,
        )
        check_run(c, self.engine.model, self.text_encoder, self.adapter, self.engine.sp_size)
        self.reward = reward if reward is not None else build_reward(c.flowgrpo.reward, self.adapter.channels)
        self.schedule = run_schedule(c, self.adapter)
        self.sigmas = self.schedule.sigmas
        self.rule = step_rule(c)
        self.prompts = list(c.prompts) or list(DEFAULT_PROMPTS)
        self.out_dir = Path(c.train.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.start_iteration = 0
        self.log = RunLog(self.out_dir, self.rank)

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.log.history

    # -------------------------------------------------------------------------------------- batches

    def iteration_batch(self, iteration: int) -> dict[str, Any]:
        """Prompts, their ragged embeddings, and the initial noise for this DP rank (same on SP peers)."""
        g = self.config.flowgrpo
        gen = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, self.engine.dp_rank))
        picks = torch.randint(len(self.prompts), (g.prompts_per_rank,), generator=gen).tolist()
        prompts = [self.prompts[i] for i in picks for _ in range(g.group_size)]
        batch: dict[str, Any] = {
            "prompts": prompts,
            **self.text_encoder.encode_batch(prompts),
            "group_ids": torch.tensor(
                [
                    self.engine.dp_rank * g.prompts_per_rank + i
                    for i in range(g.prompts_per_rank)
                    for _ in range(g.group_size)
                ]
            ),
            "latents": torch.randn(self.adapter.latent_shape(len(prompts)), generator=gen),
            "window_start": int(torch.randint(g.window_range[0], g.window_range[1], (1,), generator=gen)),
            "sde_seed": int(torch.randint(2**62, (1,), generator=gen)),
            "shuffle_seed": int(torch.randint(2**62, (1,), generator=gen)),
        }
        if g.algorithm == "dance_grpo":
            # DanceGRPO: each sample its own random subset (without replacement) of steps 0..N-2
            n, t = g.num_steps - 1, int((g.num_steps - 1) * g.timestep_fraction)
            batch["window_start"] = 0
            batch["train_steps"] = torch.stack(
                [torch.randperm(n, generator=gen)[:t] for _ in range(len(prompts))]
            )
        if g.cfg_scale > 1.0:
            batch.update(self.text_encoder.encode_batch([""] * len(prompts), prefix="negative_"))
        return batch

    def _cond(self, batch: dict[str, Any], index: torch.Tensor | None = None) -> dict[str, Any]:
        keys = (
            "prompt_embeds",
            "prompt_embeds_mask",
            "negative_prompt_embeds",
            "negative_prompt_embeds_mask",
            "pooled_prompt_embeds",
            "negative_pooled_prompt_embeds",
        )
        return {k: (batch[k] if index is None else batch[k][index]) for k in keys if k in batch}

    # ----------------------------------------------------------------------------------- one iteration

    def collect(
        self, batch: dict[str, Any]
    ) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Rollout, rewards, advantages ``[B]`` and old log-probs ``[B, W]`` for a prepared batch."""
        g = self.config.flowgrpo
        dance = g.algorithm == "dance_grpo"
        with self.engine.eval_mode():
            traj = rollout(
                self.engine,
                self.adapter,
                self._cond(batch),
                batch["latents"],
                self.schedule,
                batch["window_start"],
                self.schedule.num_steps if dance else g.window_size,
                self.rule,
                torch.Generator().manual_seed(batch["sde_seed"]),
                g.cfg_scale,
                final_is_prediction=dance,
            )
            traj.train_steps = batch.get("train_steps")
            if self.engine.debug_checks:
                self.engine.verify_sp_consistency({"final_latents": traj.final}, "rollout")
            rewards = self.reward(self.adapter.reward_view(traj.final), batch["prompts"]).float()
            old_log_probs = traj.rollout_log_probs()
            if g.recompute_old_log_probs:
                everyone = torch.arange(traj.latents.shape[0], device=traj.latents.device)
                old_log_probs = torch.stack(
                    [
                        evaluate_window_step(
                            self.engine,
                            self.adapter,
                            *traj.step_latents(everyone, k)[1:],
                            self.schedule,
                            traj.steps()[:, k],
                            self._cond(batch),
                            self.rule,
                            g.cfg_scale,
                        ).log_prob
                        for k in range(traj.steps().shape[1])
                    ],
                    dim=1,
                )
        # rewards, advantages and their statistics stay on the device (read once, below)
        rewards = to_device(rewards, traj.latents.device)
        all_rewards = self._gather_dp(rewards)
        all_groups = self._gather_dp(to_device(batch["group_ids"], rewards.device))
        # flow_grpo: batch std (population) + 1e-4; DanceGRPO: each group's unbiased std + 1e-8
        advantages_all = group_advantages(
            all_rewards,
            all_groups,
            std="group" if dance else "batch",
            eps=1e-8 if dance else 1e-4,
            clip=g.adv_clip_max,
            correction=1 if dance else 0,
        )
        b = rewards.shape[0]
        advantages = advantages_all[self.engine.dp_rank * b : (self.engine.dp_rank + 1) * b]
        if g.drop_zero_advantage:
            # read by update(); seeded from the batch, so SP peers (which share it) keep the same samples
            batch["kept_indices"] = kept_samples(
                advantages_all,
                self.engine.dp_rank,
                self.engine.dp_size,
                g.mini_batches,
                batch["shuffle_seed"] + 1,
            )
        stats = fetch_scalars(
            {
                "reward_mean": all_rewards.mean(),
                "reward_std": all_rewards.std(correction=0),
                "zero_advantage_fraction": (advantages_all == 0).double().mean(),
            }
        )
        return traj, advantages, old_log_probs.detach(), stats

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.engine.dp_group is None or self.engine.dp_size == 1:
            return t
        group = self.engine.dp_group
        mine = to_device(t, collective_device(group))
        gathered = mine.new_empty((self.engine.dp_size * mine.shape[0], *mine.shape[1:]))  # rank-major
        dist.all_gather_into_tensor(gathered, mine, group=group)
        return to_device(gathered, t.device)

    def update(
        self, batch: dict[str, Any], traj: Trajectory, advantages: torch.Tensor, old_log_probs: torch.Tensor
    ) -> dict[str, float]:
        """The policy update on one rollout (``update.policy_update``), on ``batch["kept_indices"]`` when
        ``collect`` chose some (the zero-advantage filter), else on every sample."""
        metrics = policy_update(
            self.engine,
            self.adapter,
            self.schedule,
            self.rule,
            self.config.flowgrpo,
            traj,
            advantages,
            old_log_probs,
            lambda idx: self._cond(batch, idx),
            batch["shuffle_seed"],
            batch.get("kept_indices"),
        )
        if metrics["trained_samples"] == 0:  # every advantage 0 on every rank: no step anywhere
            lr = self.engine.optimizer.param_groups[0]["lr"]
            zero = ("loss", "policy_loss", "kl", "ppo_kl", "clipfrac", "grad_norm")
            metrics.update({k: 0.0 for k in zero}, ratio_mean=1.0, ratio_std=0.0, lr=lr, step_skipped=1.0)
        return metrics

    def train_iteration(self, iteration: int) -> dict[str, Any]:
        start = time.perf_counter()
        # token counts were checked against the SP degree through the adapter (latent layouts differ)
        batch = self.engine.prepare_batch(self.iteration_batch(iteration))
        traj, advantages, old_log_probs, stats = self.collect(batch)
        metrics = self.update(batch, traj, advantages, old_log_probs)
        metrics.update(stats)
        metrics["iteration"] = iteration + 1
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------- loop

    def _resume(self) -> None:
        if not self.config.train.resume or find_latest(self.ckpt_dir) is None:
            return
        extra = self.engine.load_checkpoint(self.ckpt_dir)
        self.start_iteration = int(extra.get("iteration", 0))
        if self.rank == 0:
            print(
                f"resumed from {find_latest(self.ckpt_dir)} at iteration {self.start_iteration}", flush=True
            )
        self.log.truncate(self.start_iteration)

    def save(self, iteration: int) -> Path:
        return self.engine.save_checkpoint(self.ckpt_dir, step=iteration, extra={"iteration": iteration})

    def run(self) -> list[dict[str, Any]]:
        """Train to ``train.iterations``, resuming from the newest checkpoint; one run per ``train.out_dir`` at a
        time (``RunDirInUse`` on every rank otherwise)."""
        lock = lock_run_dir(self.out_dir, self.rank)
        try:
            return self._run()
        finally:
            if lock is not None:
                lock.close()

    def _run(self) -> list[dict[str, Any]]:
        c = self.config.train
        self.log.open(self.config.to_dict())
        if dist.is_initialized():
            dist.barrier()
        self._resume()
        if self.start_iteration >= c.iterations:
            if self.rank == 0:
                print(
                    f"nothing to train: the checkpoint in {self.ckpt_dir} is at iteration {self.start_iteration}, "
                    f"and train.iterations={c.iterations}; fix: pass --iterations N with N > {self.start_iteration} "
                    "to continue this run, or --out-dir DIR (or train.resume=false) to start a new one",
                    flush=True,
                )
            self.log.close(plot=False)
            return self.history
        bar = None
        if self.rank == 0 and c.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=c.iterations,
                initial=self.start_iteration,
                desc="FlowGRPO",
                unit="it",
                dynamic_ncols=True,
            )
        for it in range(self.start_iteration, c.iterations):
            metrics = self.train_iteration(it)
            self.log.append(metrics)
            if bar is not None:
                bar.update(1)
                # what moves in an on-policy run (its loss is ~0 and ppo_kl 0 by construction)
                bar.set_postfix(
                    reward=f"{metrics['reward_mean']:+.3f}",
                    clip=f"{metrics.get('clipfrac', 0.0):.2f}",
                    grad=f"{metrics.get('grad_norm', 0.0):.2f}",
                    s_it=f"{metrics['seconds']:.1f}",
                )
            if c.save_every and (it + 1) % c.save_every == 0 and it + 1 < c.iterations:
                self.save(it + 1)
        if bar is not None:
            bar.close()
        if self.start_iteration < c.iterations:
            self.save(c.iterations)
        layout = self.engine.layout
        self.log.close(
            plot=c.plot,
            title=f"{self.out_dir.name}: {self.config.model.kind}, dp {layout.dp} x ring {layout.ring} x "
            f"ulysses {layout.ulysses}, {len(self.history)} iterations",
        )
        return self.history
