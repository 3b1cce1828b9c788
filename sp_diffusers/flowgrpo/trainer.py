"""The FlowGRPO loop on top of ``FSDPEngine``: rollout -> reward -> old log-probs -> advantages -> update.

Data parallel ranks draw different prompts; the ranks of one SP group draw the same ones (every random
choice is seeded by (seed, iteration, dp rank), never by the global rank) and the engine broadcasts the
batch from the group's first rank anyway. Rank 0 writes ``metrics.jsonl`` (and TensorBoard when
installed), ``reward_loss.png`` and shows a tqdm bar; checkpoints go to ``<out_dir>/checkpoints`` and a
restarted run resumes from the newest one.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine import FSDPEngine, LoraSettings, OptimSettings
from ..engine.checkpoint import find_latest
from .advantages import group_advantages
from .config import TrainConfig
from .loss import flowgrpo_loss
from .models import build_adapter
from .rewards import Reward, build_reward
from .rollout import Trajectory, evaluate_window_step, rollout
from .schedule import flow_sigmas
from .text import DEFAULT_PROMPTS, ByteTextEncoder, PipelineTextEncoder

logger = logging.getLogger(__name__)

__all__ = ["FlowGRPOTrainer", "init_distributed"]


def init_distributed(timeout_s: float = 600.0) -> None:
    """Join the process group torchrun / accelerate launch describe in the environment (no-op otherwise)."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    # Under torchrun the store outlives a restart; gloo then reads the dead attempt's peer addresses and
    # fails to connect ("connectFullMesh ... Connection refused"). A per-attempt key prefix isolates them.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts_store,
    )
    store = dist.PrefixStore(f"sp_diffusers/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


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
        engine_factory: Callable[..., FSDPEngine] | None = None,
    ) -> None:
        """``engine_factory(model, **FSDPEngine kwargs)`` builds the engine (default ``FSDPEngine``; the verl
        integration passes one that builds it through verl's ``EngineRegistry``)."""
        init_distributed()
        self.config = config
        c = config
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        model = model if model is not None else self._build_model()
        lora = None
        if c.lora.enabled:
            lora = LoraSettings(
                rank=c.lora.rank,
                alpha=c.lora.alpha,
                target_modules=tuple(c.lora.target_modules),
                init=c.lora.init,
            )
        self.engine = (engine_factory or FSDPEngine)(
            model,
            ulysses_sequence_parallel_size=c.parallel.ulysses_sequence_parallel_size,
            ring_degree=c.parallel.ring_degree,
            optim=OptimSettings(
                lr=c.optim.lr,
                eps=c.optim.eps,
                weight_decay=c.optim.weight_decay,
                max_grad_norm=c.optim.max_grad_norm,
                warmup_steps=c.optim.warmup_steps,
            ),
            lora=lora,
            use_fsdp=c.parallel.use_fsdp,
            mixed_precision=c.parallel.mixed_precision or None,
            activation_checkpointing=c.parallel.activation_checkpointing,
            debug_checks=c.parallel.debug_checks,
        )
        self.text_encoder: ByteTextEncoder | PipelineTextEncoder
        if c.text.pipeline:
            # on the training device, in the training precision: T5-XXL alone is 4.7B parameters
            self.text_encoder = PipelineTextEncoder(
                c.text.pipeline,
                c.text.max_sequence_length,
                device=self.engine.device,
                dtype=torch.bfloat16 if c.parallel.mixed_precision == "bf16" else torch.float32,
            )
        else:
            self.text_encoder = ByteTextEncoder(
                hidden_size=c.text.hidden_size, num_layers=c.text.num_layers, seed=c.text.seed
            )
        self.adapter = build_adapter(
            self.engine.model, c.model.image_size, pooled_from_encoder=bool(c.text.pipeline)
        )
        text_dim = getattr(self.engine.model.config, "joint_attention_dim", None)
        if text_dim is not None and text_dim != self.text_encoder.hidden_size:
            key = "text.pipeline" if c.text.pipeline else "text.hidden_size"
            raise ValueError(
                f"{key}: the text encoder gives {self.text_encoder.hidden_size}-wide embeddings but the model's "
                f"joint_attention_dim is {text_dim}; fix: use the pipeline that matches the transformer, or set "
                f"text.hidden_size={text_dim}"
            )
        if self.adapter.tokens % self.engine.sp_size:
            raise ValueError(
                f"model.image_size={c.model.image_size} gives {self.adapter.tokens} image tokens, not divisible by "
                f"the SP degree {self.engine.sp_size}; fix: pick an image_size whose token count is a multiple of it"
            )
        self.reward = reward if reward is not None else build_reward(c.flowgrpo.reward, self.adapter.channels)
        g = c.flowgrpo
        self.sigmas = flow_sigmas(g.num_steps, shift=g.shift or None)
        lo, hi = g.window_range
        if not (0 <= lo < hi <= g.num_steps - g.window_size + 1):
            raise ValueError(
                f"flowgrpo.window_range={g.window_range} must satisfy 0 <= lo < hi <= num_steps - window_size + 1 "
                f"= {g.num_steps - g.window_size + 1}"
            )
        if g.kl_coef > 0 and lora is None:
            raise ValueError(
                "flowgrpo.kl_coef > 0 needs a reference policy; fix: enable lora (the reference is the base "
                "model with adapters disabled) or set flowgrpo.kl_coef=0"
            )
        self.prompts = list(c.prompts) or list(DEFAULT_PROMPTS)
        self.out_dir = Path(c.train.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.start_iteration = 0
        self.history: list[dict[str, Any]] = []
        self._tb = None

    def _build_model(self) -> torch.nn.Module:
        from ..tiny import _model_class, tiny_model

        c = self.config.model
        if c.pretrained:
            if not Path(c.pretrained).exists():
                raise FileNotFoundError(
                    f"model.pretrained={c.pretrained!r} does not exist (a save_pretrained folder)"
                )
            return _model_class(c.kind).from_pretrained(c.pretrained)
        return tiny_model(c.kind, seed=c.seed, **c.overrides)

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
        with self.engine.eval_mode():
            traj = rollout(
                self.engine,
                self.adapter,
                self._cond(batch),
                batch["latents"],
                self.sigmas,
                batch["window_start"],
                g.window_size,
                g.noise_level,
                torch.Generator().manual_seed(batch["sde_seed"]),
                g.cfg_scale,
            )
            if self.engine.debug_checks:
                self.engine.verify_sp_consistency({"final_latents": traj.final}, "rollout")
            rewards = self.reward(self.adapter.reward_view(traj.final), batch["prompts"]).float().cpu()
            old_log_probs = traj.log_probs
            if g.recompute_old_log_probs:
                old_log_probs = torch.stack(
                    [
                        evaluate_window_step(
                            self.engine,
                            self.adapter,
                            traj.latents[:, k],
                            traj.latents[:, k + 1],
                            self.sigmas,
                            traj.window_start + k,
                            self._cond(batch),
                            g.noise_level,
                            g.cfg_scale,
                        ).log_prob
                        for k in range(g.window_size)
                    ],
                    dim=1,
                )
        all_rewards, all_groups = self._gather_dp(rewards), self._gather_dp(batch["group_ids"].cpu())
        advantages_all = group_advantages(all_rewards, all_groups, clip=g.adv_clip_max)
        b = rewards.shape[0]
        advantages = advantages_all[self.engine.dp_rank * b : (self.engine.dp_rank + 1) * b]
        stats = {"reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std(correction=0).item()}
        return traj, advantages.to(traj.latents.device), old_log_probs.detach(), stats

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        if self.engine.dp_group is None or self.engine.dp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.engine.dp_size)]
        if dist.get_backend(self.engine.dp_group) == "nccl":
            parts = [p.cuda() for p in parts]
            dist.all_gather(parts, t.cuda(), group=self.engine.dp_group)
            parts = [p.cpu() for p in parts]
        else:
            dist.all_gather(parts, t, group=self.engine.dp_group)
        return torch.cat(parts)

    def update(
        self, batch: dict[str, Any], traj: Trajectory, advantages: torch.Tensor, old_log_probs: torch.Tensor
    ) -> dict[str, float]:
        """Mini-batches x micro-batches x window steps; one backward per window step per micro-batch."""
        g = self.config.flowgrpo
        engine = self.engine
        n = traj.latents.shape[0]
        sums: dict[str, float] = {}
        count = 0
        optim_metrics: dict[str, float] = {}
        for epoch in range(g.inner_epochs):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(batch["shuffle_seed"] + epoch))
            minis = perm.chunk(g.mini_batches)
            for mini in minis:
                micros = mini.split(g.micro_batch_size)
                normalizer = float(len(micros) * g.window_size)
                engine.zero_grad()
                for micro in micros:
                    idx = micro.to(traj.latents.device)
                    cond = self._cond(batch, idx)
                    for k in range(g.window_size):

                        def loss_fn(eng, _batch, k=k, idx=idx, cond=cond, normalizer=normalizer):
                            def evaluate():
                                return evaluate_window_step(
                                    eng,
                                    self.adapter,
                                    traj.latents[idx, k],
                                    traj.latents[idx, k + 1],
                                    self.sigmas,
                                    traj.window_start + k,
                                    cond,
                                    g.noise_level,
                                    g.cfg_scale,
                                )

                            step = evaluate()
                            kl_args = {}
                            if g.kl_coef > 0:
                                with torch.no_grad(), eng.adapters_disabled():
                                    ref = evaluate()  # the reference policy: the base model, adapters off
                                kl_args = dict(
                                    prev_sample_mean=step.prev_sample_mean,
                                    ref_prev_sample_mean=ref.prev_sample_mean,
                                    std_dev_t=step.std_dev_t,
                                )
                            return flowgrpo_loss(
                                step.log_prob,
                                old_log_probs[idx, k],
                                advantages[idx],
                                clip_range=g.clip_range,
                                normalizer=normalizer,
                                kl_coef=g.kl_coef,
                                **kl_args,
                            )

                        metrics = engine.forward_backward(batch, loss_fn)
                        for key, value in metrics.items():
                            if isinstance(value, float):
                                sums[key] = sums.get(key, 0.0) + value
                        count += 1
                optim_metrics = engine.optimizer_step()
        out = {k: v / max(1, count) for k, v in sums.items()}
        out.update(optim_metrics)
        return out

    def train_iteration(self, iteration: int) -> dict[str, Any]:
        start = time.perf_counter()
        # token counts were checked against the SP degree through the adapter (latent layouts differ)
        batch = self.engine.prepare_batch(self.iteration_batch(iteration), image_keys=())
        traj, advantages, old_log_probs, stats = self.collect(batch)
        metrics = self.update(batch, traj, advantages, old_log_probs)
        metrics.update(stats)
        metrics["iteration"] = iteration + 1
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------- loop

    def _log(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        if self.rank != 0:
            return
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, metrics["iteration"])

    def _resume(self) -> None:
        if not self.config.train.resume or find_latest(self.ckpt_dir) is None:
            return
        extra = self.engine.load_checkpoint(self.ckpt_dir)
        self.start_iteration = int(extra.get("iteration", 0))
        if self.rank == 0:
            print(
                f"resumed from {find_latest(self.ckpt_dir)} at iteration {self.start_iteration}", flush=True
            )
        path = self.out_dir / "metrics.jsonl"
        if self.rank == 0 and path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line)["iteration"] <= self.start_iteration
            ]
            path.write_text("".join(line + "\n" for line in kept))
            self.history = [json.loads(line) for line in kept]

    def save(self, iteration: int) -> Path:
        return self.engine.save_checkpoint(self.ckpt_dir, step=iteration, extra={"iteration": iteration})

    def run(self) -> list[dict[str, Any]]:
        c = self.config.train
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self._tb = None
        if dist.is_initialized():
            dist.barrier()
        self._resume()
        iterations = range(self.start_iteration, c.iterations)
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
        for it in iterations:
            metrics = self.train_iteration(it)
            self._log(metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['reward_mean']:+.3f}",
                    loss=f"{metrics.get('loss', 0.0):+.4f}",
                    kl=f"{metrics.get('ppo_kl', 0.0):.1e}",
                    s_it=f"{metrics['seconds']:.1f}",
                )
            if c.save_every and (it + 1) % c.save_every == 0 and it + 1 < c.iterations:
                self.save(it + 1)
        if bar is not None:
            bar.close()
        if self.start_iteration < c.iterations:
            self.save(c.iterations)
        if self.rank == 0:
            if self._tb is not None:
                self._tb.close()
            if c.plot:
                from .plot import plot_metrics

                plot_metrics(self.history, self.out_dir / "reward_loss.png")
        return self.history
