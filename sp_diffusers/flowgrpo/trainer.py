"""The RL loop on top of ``FSDPEngine``: batch -> rollout -> old log-probs -> reward -> advantages -> update.

The loop knows phases, not algorithms: ``flowgrpo.algorithm`` picks an ``Algorithm`` (``algorithms/``: flow_grpo,
dance_grpo, ...), and the loop asks it what to draw for a batch (its window, its trained steps), which rollout
steps are stochastic, how rewards become advantages and what one trained step's loss is. With
``flowgrpo.drop_zero_advantage`` only samples with a non-zero advantage are trained (``algorithms/selection.py``:
the same count on every dp rank).

Data parallel ranks draw different prompts; the ranks of one SP group draw the same ones (every random
choice is seeded by (seed, iteration, dp rank), never by the global rank) and the engine broadcasts the
batch from the group's first rank anyway. Rank 0 writes ``metrics.jsonl`` (TensorBoard, W&B: ``train.loggers``),
``metrics.png`` and shows a tqdm bar; checkpoints go to ``<out_dir>/checkpoints`` and a restarted run resumes from
the newest one.

Each iteration's rollout, old log-probs, rewards and advantages: ``collect.py`` (a rollout holds its weights gathered
and runs classifier-free guidance as one forward: ``sampling/guidance.py``); the policy update: ``update.py``;
every collective of an iteration is counted by phase and kind (``sp_diffusers.parallel.ledger``) into its metrics
(``comm/<phase>/<kind>_calls`` and ``_bytes``). Building the parts from the config: ``build.py`` (a pipeline
folder: ``models/pipeline_io.py``; Wan2.2's experts: ``models/experts.py``); prompts: ``io/data.py``; rewards:
``rewards/scoring.py``; eval and sample grids: ``io/evaluate.py``; metrics: ``io/metrics.py``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine import EngineSettings, FSDPEngine
from ..engine.checkpoint import find_latest
from ..parallel.devices import to_device
from ..parallel.launch import init_distributed
from ..parallel.ledger import CommLedger, as_metrics
from .algorithms.base import StepContext
from .algorithms.registry import algorithm_for
from .build import (
    build_text_encoder,
    check_algorithm,
    check_run,
    run_schedule,
)
from .collect import collect, gather_dp
from .config import TrainConfig, validate
from .io.data import PromptRow, PromptStream, read_prompts
from .io.evaluate import Evaluator
from .io.metrics import RunLog
from .io.run_lock import lock_run_dir
from .models.adapters import build_adapter
from .models.conditioning import build_conditioning, with_sources
from .models.decode import PixelDecoder
from .models.experts import ExpertEngines, build_engines, check_expert_steps
from .models.pipeline_io import load_vae, resolve_pipeline
from .models.text import DEFAULT_PROMPTS
from .rewards.builtin import Reward
from .rewards.scoring import RewardSet
from .sampling.guidance import WeightHolder, gathers_once
from .sampling.rollout import Trajectory
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
        self.algorithm = algorithm_for(c)  # the one place the loop meets the algorithm's name (algorithms/)
        # the model folder (JSON only: model.kind against its class, the components this run loads) and the prompt
        # files first, in train --check's order: a mistake in either fails before any model is built
        resolve_pipeline(c)
        train_rows = read_prompts(c.data.train, "data.train") if c.data.train else []
        eval_rows = read_prompts(c.data.eval, "data.eval") if c.data.eval else []
        # FSDP2 warns when a wrapped model returns a view (Wan's unpatchify does); the warning is about in-place
        # ops on that view, and the trainer only ever reads the velocity (every op on it is out of place)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # one engine, or Wan2.2's two experts (experts.py)
        self.engine = build_engines(c, model, engine_factory or FSDPEngine)
        self.text_encoder = build_text_encoder(c, self.engine.device)
        self.adapter = build_adapter(
            self.engine.model,
            c.model.image_size,
            pooled_from_encoder=bool(c.text.pipeline or c.model.pipeline),
            frames=c.model.frames,
            text_len=c.text.max_sequence_length,
            guidance_scale=c.flowgrpo.guidance_scale,
            image_width=c.model.image_width,
        )
        # editing / image-to-video pipelines: the condition's adapter and its encoder (models/conditioning.py)
        self.adapter, self.conditioner = build_conditioning(
            c, self.engine.model, self.text_encoder, self.adapter, train_rows + eval_rows
        )
        check_run(c, self.engine.model, self.text_encoder, self.adapter, self.engine.sp_size)
        # a callable (latents, prompts) -> [B] given here (or set later) replaces the configured rewards
        self.reward = reward
        vae = load_vae(c)  # model.pipeline's: pixels for rewards and sample grids
        self.decoder = (
            PixelDecoder(vae, self.adapter, self.engine.device, c.flowgrpo.micro_batch_size) if vae else None
        )
        self.rewards = RewardSet.from_config(c, self.adapter, self.engine, self.decoder)
        self.schedule = run_schedule(c, self.adapter)
        self.sigmas = self.schedule.sigmas
        if isinstance(self.engine, ExpertEngines):
            self.engine.bind_schedule(self.schedule.timesteps)
            check_expert_steps(self.engine, self.algorithm)
        self.rule = self.algorithm.step_rule()
        self.prompts = list(c.prompts) or list(DEFAULT_PROMPTS)
        # data.train: a per-epoch shuffled stream (data.py); (iteration, position) the run continues from
        self.stream = PromptStream(train_rows, c.train.seed) if train_rows else None
        self.data_base = (0, 0)
        self.evaluator = Evaluator(
            self, eval_rows, eval_rows or train_rows or [PromptRow(p) for p in self.prompts]
        )
        self.out_dir = Path(c.train.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.start_iteration = 0
        self.log = RunLog(self.out_dir, self.rank, tuple(c.train.loggers), c.train.wandb_project)
        self._gather_once: bool | None = None  # rollout.gather_params, decided at the first rollout
        self._update_gather: bool | None = None  # update.gather_params, decided at the first update
        self.ledger = CommLedger()  # every collective of an iteration, by phase and kind (ledger.py)
        self.algorithm.attach(self.engine)  # what it keeps beside the model (DiffusionNFT: the old policy)

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.log.history

    # -------------------------------------------------------------------------------------- batches

    def iteration_batch(self, iteration: int) -> dict[str, Any]:
        """Prompts, their ragged embeddings, and the initial noise for this DP rank (same on SP peers)."""
        g = self.config.flowgrpo
        gen = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, self.engine.dp_rank))
        if self.stream is not None:
            start = self.data_position(iteration) + self.engine.dp_rank * g.prompts_per_rank
            rows = self.stream.rows_at(start, g.prompts_per_rank)
        else:
            picks = torch.randint(len(self.prompts), (g.prompts_per_rank,), generator=gen).tolist()
            rows = [PromptRow(self.prompts[i]) for i in picks]
        prompts = [r.prompt for r in rows for _ in range(g.group_size)]
        batch: dict[str, Any] = {
            "prompts": prompts,
            "metadata": [r.metadata for r in rows for _ in range(g.group_size)],
            **self.encode_rows(rows, prompts),
            "group_ids": torch.tensor(
                [
                    self.engine.dp_rank * g.prompts_per_rank + i
                    for i in range(g.prompts_per_rank)
                    for _ in range(g.group_size)
                ]
            ),
            "latents": torch.randn(self.adapter.latent_shape(len(prompts)), generator=gen),
        }
        self.algorithm.plan(batch, gen)  # its window, its trained steps (algorithms/)
        # what moves with training (MixGRPO's window): seeded by the iteration alone, the same on every rank
        shared = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, 0x31))
        self.algorithm.plan_iteration(batch, iteration, shared)
        batch["sde_seed"] = int(torch.randint(2**62, (1,), generator=gen))
        batch["shuffle_seed"] = int(torch.randint(2**62, (1,), generator=gen))
        if g.cfg_scale > 1.0 and self.conditioner is None:
            batch.update(self.text_encoder.encode_batch([""] * len(prompts), prefix="negative_"))
        if isinstance(self.engine, ExpertEngines):  # every rank trains the same expert at a time
            gen = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, 0x2E))
            self.algorithm.share_plan(batch, set(self.engine.trainable_steps()), gen)
        return batch

    def encode_rows(self, rows: list[PromptRow], prompts: list[str]) -> dict[str, Any]:
        """The text of ``prompts`` (each row's prompt repeated over its group); for an image-conditioned family each
        row's text and condition once, shared by its group, and the empty prompt's for CFG (``conditioning.py``)."""
        if self.conditioner is None:
            return self.text_encoder.encode_batch(prompts)
        repeat = len(prompts) // max(1, len(rows))
        return self.conditioner.encode(rows, repeat, negative=self.config.flowgrpo.cfg_scale > 1.0)

    def data_position(self, iteration: int) -> int:
        """The stream position iteration ``iteration`` starts at (each takes dp x prompts_per_rank prompts)."""
        base_iteration, base_position = self.data_base
        per_iteration = self.engine.dp_size * self.config.flowgrpo.prompts_per_rank
        return base_position + (iteration - base_iteration) * per_iteration

    def _cond(self, batch: dict[str, Any], index: torch.Tensor | None = None) -> dict[str, Any]:
        keys = (
            "prompt_embeds",
            "prompt_embeds_mask",
            "negative_prompt_embeds",
            "negative_prompt_embeds_mask",
            "pooled_prompt_embeds",
            "negative_pooled_prompt_embeds",
        )
        keys += tuple(k for k in batch if k.startswith("condition_"))  # an image condition (conditioning.py)
        return {k: (batch[k] if index is None else batch[k][index]) for k in keys if k in batch}

    # ----------------------------------------------------------------------------------- one iteration

    def collect(
        self, batch: dict[str, Any]
    ) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Rollout, old log-probs ``[B, T]`` (both on weights gathered once: ``rollout.gather_params``), then
        rewards and advantages ``[B]``, for a prepared batch (``collect.py``)."""
        return collect(self, batch)

    def weight_holder(self) -> WeightHolder:
        """Holds a rollout's weights gathered from its first forward to its end where ``rollout.gather_params``
        chose so (decided once per run, the same on every rank: ``guidance.gathers_once``)."""
        if self._gather_once is None:
            self._gather_once = gathers_once(self.config.rollout.gather_params, self.engine)
        return WeightHolder(self._gather_once)

    def score(
        self, final: torch.Tensor, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The total reward ``[B]`` (float32) of the final latents and each reward's scores (``reward_scoring``;
        split over the SP group, identical on its ranks), on the latents' device."""
        if self.reward is not None:
            return self.reward(self.adapter.reward_view(final), batch["prompts"]).float(), {}
        metadata = with_sources(batch.get("metadata"), batch.get("source_pixels"), final.shape[0])
        total, each = self.rewards(final, batch["prompts"], metadata)
        return to_device(total, final.device), to_device(each, final.device)

    def _update_holds(self) -> bool:
        """``update.gather_params``, decided at the first update (after a rollout: its activations are freed), the
        same on every rank (``guidance.gathers_once``)."""
        if self._update_gather is None:
            self._update_gather = gathers_once(self.config.update.gather_params, self.engine)
        return self._update_gather

    def _gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        return gather_dp(self.engine, t)

    def update(
        self, batch: dict[str, Any], traj: Trajectory, advantages: torch.Tensor, old_log_probs: torch.Tensor
    ) -> dict[str, float]:
        """The policy update on one rollout (``update.policy_update``), on ``batch["kept_indices"]`` when
        ``collect`` chose some (the zero-advantage filter), else on every sample."""
        metrics = policy_update(
            self.engine,
            self.algorithm,
            StepContext(self.adapter, self.schedule, self.rule, self.config),
            traj,
            advantages,
            old_log_probs,
            lambda idx: self._cond(batch, idx),
            batch["shuffle_seed"],
            batch.get("kept_indices"),
            self._update_holds(),
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
        metrics.update(self.algorithm.after_update(self.engine))  # e.g. DiffusionNFT's old-policy decay
        metrics.update(stats)
        metrics.update(self.algorithm.iteration_metrics(batch))
        if self.stream is not None:
            metrics["epoch"] = self.data_position(iteration + 1) / len(self.stream)
        metrics["iteration"] = iteration + 1
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------- loop

    def _resume(self) -> None:
        latest = getattr(self.engine, "find_latest", find_latest)  # two experts: one root each
        if not self.config.train.resume or latest(self.ckpt_dir) is None:
            return
        extra = self.engine.load_checkpoint(self.ckpt_dir)
        self.algorithm.attach(self.engine)  # its state follows the loaded weights
        self.start_iteration = int(extra.get("iteration", 0))
        # checkpoints older than data files: the position an unchanged layout reaches
        self.data_base = (
            self.start_iteration,
            int(extra.get("data_position", self.data_position(self.start_iteration))),
        )
        if self.rank == 0:
            print(f"resumed from {latest(self.ckpt_dir)} at iteration {self.start_iteration}", flush=True)
        self.log.truncate(self.start_iteration)

    def save(self, iteration: int) -> Path:
        extra = {"iteration": iteration, "data_position": self.data_position(iteration)}
        return self.engine.save_checkpoint(self.ckpt_dir, step=iteration, extra=extra)

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
        if c.progress:
            self.log.start_progress(c.iterations, self.start_iteration)
        for it in range(self.start_iteration, c.iterations):
            with self.ledger.recording():
                metrics = self.train_iteration(it)
                if c.eval_every and (it + 1) % c.eval_every == 0:
                    metrics.update(self.evaluator.evaluate())
                if c.sample_every and (it + 1) % c.sample_every == 0:
                    self.evaluator.write_samples(it + 1)
            metrics.update(
                as_metrics(self.ledger.take())
            )  # this rank's collectives, as metrics.jsonl keeps them
            metrics["rollout_gathered_once"] = float(bool(self._gather_once))
            metrics["update_gathered_once"] = float(bool(self._update_gather))
            self.log.append(metrics)  # and the progress bar
            if c.save_every and (it + 1) % c.save_every == 0 and it + 1 < c.iterations:
                self.save(it + 1)
        if self.start_iteration < c.iterations:
            self.save(c.iterations)
        layout = self.engine.layout
        self.log.close(
            plot=c.plot,
            title=f"{self.out_dir.name}: {self.config.model.kind}, dp {layout.dp} x ring {layout.ring} x "
            f"ulysses {layout.ulysses}, {len(self.history)} iterations",
        )
        return self.history
