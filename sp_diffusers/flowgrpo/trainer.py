"""The RL loop on top of ``FSDPEngine``, one iteration top to bottom (:meth:`FlowGRPOTrainer.train_iteration`):

    batch       prompts, their conditioning, the initial noise and the algorithm's plan (``batch.py``)
    rollout     the denoising run with the algorithm's span of stochastic steps, on weights gathered once
                (``rollout.gather_params``), classifier-free guidance in one forward (``sampling/``); with
                ``rollout.chunks`` in pieces, each piece's rewards scored in the background as the next samples
    old policy  the trained steps' log-probs (and step means) recomputed on the update's own micro-batches
    rewards     scored over the SP group (or the background scoring's shares gathered), gathered over data
                parallelism; group-relative advantages; the zero-advantage filter (``algorithms/selection.py``: the
                same count on every dp rank)
    update      mini-batches x micro-batches x trained steps, each the algorithm's loss (``update.py``); with
                ``update.lag: 1`` on the previous iteration's rollout, whose rewards were scored meanwhile

The loop knows phases, not algorithms: ``flowgrpo.algorithm`` picks an ``Algorithm`` (``algorithms/``), and the loop
asks it for its plan, its span, its advantages and its loss of the inputs it declares.

Data parallel ranks draw different prompts; the ranks of one SP group draw the same ones (every random choice is
seeded by (seed, iteration, dp rank), never by the global rank) and the engine broadcasts the batch's tensors from
the group's first rank anyway. Rank 0 writes ``metrics.jsonl`` (TensorBoard, W&B: ``train.loggers``),
``metrics.png`` and shows a tqdm bar; checkpoints go to ``<out_dir>/checkpoints`` and a restarted run resumes from
the newest one. Every collective of an iteration is counted by phase and kind (``sp_diffusers.parallel.ledger``)
into its metrics (``comm/<phase>/<kind>_calls`` and ``_bytes``), and each phase's time too (``timing.py``:
``phase_seconds/<phase>``: batch, rollout, old_log_probs, reference, reward, update).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine import EngineSettings, FSDPEngine
from ..engine.checkpoint_files import agree
from ..engine.compiling import compiled_graphs
from ..parallel.devices import fetch_scalars, to_device
from ..parallel.launch import init_distributed, record_peers
from ..parallel.ledger import CommLedger, as_metrics, comm_phase
from ..parallel.padding import length_bucket
from .algorithms.base import RewardTable, StepContext, Targets
from .algorithms.diffusion_dpo import check_pair_family
from .algorithms.registry import algorithm_for
from .batch import IterationBatch
from .build import (
    build_text_encoder,
    check_algorithm,
    check_run,
    run_schedule,
)
from .config import ConfigError, TrainConfig, validate
from .io.data import PromptRow, PromptStream, read_prompts
from .io.evaluate import Evaluator
from .io.metrics import RunLog
from .io.preferences import PairLatents, read_pairs
from .io.run_lock import lock_run_dir
from .io.run_record import read_record, resume_problem, run_record
from .models.adapters import build_adapter
from .models.conditioning import PromptEncoder, build_conditioning
from .models.decode import PixelDecoder, PixelEncoder
from .models.experts import ExpertEngines, build_engines, check_expert_steps, route
from .models.ltx2 import AudioDecoder
from .models.pipeline_io import load_audio_decoders, load_vae, resolve_pipeline
from .models.text import DEFAULT_PROMPTS
from .rewards.builtin import Reward
from .rewards.features import features_for
from .rewards.overlap import BackgroundScoring
from .rewards.scoring import RewardSet, Scorer
from .sampling.denoise import Sampler, denoise, denoise_in_chunks, evaluate_step
from .sampling.guidance import WeightHolder, gathers_once
from .sampling.trajectory import Trajectory
from .timing import PhaseClock
from .update import evaluate_trained_step, micro_batches, policy_update

__all__ = ["FlowGRPOTrainer"]

EngineFactory = Callable[[torch.nn.Module, EngineSettings], FSDPEngine]
EVAL_PAIR_DRAWS = 4  # forward-process points per held-out preference pair (flowgrpo.dpo.eval_pairs)


def _seed(*parts: int) -> int:
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value * 6364136223846793005 + int(p) + 1442695040888963407) % (2**63 - 1)
    return value


@dataclass
class Sampled:
    """A batch rolled out, its old policy's log-probs ``[B, T]`` (and ``kl`` ``[B, T]``: flowgrpo.kl_reward), its
    rewards being scored by ``scoring`` in the background, or (None) scored when its advantages are asked for."""

    batch: IterationBatch
    traj: Trajectory
    old_log_probs: torch.Tensor
    kl: torch.Tensor | None
    scoring: BackgroundScoring | None


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
        record_peers()  # so that a rank that dies mid-run is named (the CLI's one line)
        self.config = c = config
        check_algorithm(c)
        self.algorithm = algorithm_for(c)  # the one place the loop meets the algorithm's name (algorithms/)
        # the model folder (JSON only: model.kind against its class, the components this run loads) and the prompt
        # files first, in train --check's order: a mistake in either fails before any model is built
        resolve_pipeline(c)
        limit = c.data.max_image_pixels
        train_rows = read_prompts(c.data.train, "data.train", limit) if c.data.train else []
        eval_rows = read_prompts(c.data.eval, "data.eval", limit) if c.data.eval else []
        # Diffusion-DPO offline: preference pairs trained instead of rollouts, and held-out pairs (io/preferences.py)
        dpo = c.flowgrpo.dpo
        pair_rows = read_pairs(dpo.pairs, "flowgrpo.dpo.pairs", limit) if dpo.pairs else []
        eval_pair_rows = read_pairs(dpo.eval_pairs, "flowgrpo.dpo.eval_pairs", limit) if dpo.eval_pairs else []
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
            audio_frames=c.model.audio_frames,
            frame_rate=c.model.frame_rate,
            pipeline=c.model.pipeline,
        )
        # editing / image-to-video pipelines: the condition's adapter and its encoder (models/conditioning.py)
        self.adapter, self.conditioner = build_conditioning(
            c, self.engine.model, self.text_encoder, self.adapter, train_rows + eval_rows
        )
        check_run(c, self.engine.model, self.text_encoder, self.adapter, self.engine.sp_size)
        self.prompt_encoder = PromptEncoder(
            self.text_encoder,
            self.conditioner,
            negative=c.flowgrpo.cfg_scale > 1.0,
            cache_mb=c.text.cache_mb,
            # Z-Image: each row's text length on the host beside its text (no forward reads a mask back)
            lengths=self.adapter.host_text_lengths,
        )
        vae = load_vae(c)  # model.pipeline's: pixels for rewards and sample grids
        self.decoder = (
            PixelDecoder(vae, self.adapter, self.engine.device, c.flowgrpo.micro_batch_size) if vae else None
        )
        audio = load_audio_decoders(c)  # LTX-2's audio VAE and vocoder: waveforms beside the pixels
        self.audio_decoder = AudioDecoder(*audio, self.adapter, self.engine.device) if audio else None
        self.pair_latents = self._pair_latents(vae) if pair_rows or eval_pair_rows else None
        self.eval_pair_rows = eval_pair_rows
        # a callable (latents, prompts) -> [B] given here (or set later: trainer.reward) replaces the configured ones
        features = features_for(self.algorithm.image_features(), self.engine.device)  # GARDO's diversity features
        rewards = RewardSet.from_config(c, self.adapter, self.engine, self.decoder, features, self.audio_decoder)
        self.scorer = Scorer(rewards, self.adapter.reward_view, reward)
        self.schedule = run_schedule(c, self.adapter)
        self.sigmas = self.schedule.sigmas
        if isinstance(self.engine, ExpertEngines):
            if c.flowgrpo.kl_reward > 0:
                raise ConfigError("flowgrpo.kl_reward does not run on a two-expert model yet; fix: flowgrpo.kl_reward=0")
            self.engine.bind_schedule(self.schedule.timesteps)
            check_expert_steps(self.engine, self.algorithm)
        self.rule = self.algorithm.step_rule()
        self.prompts = list(c.prompts) or list(DEFAULT_PROMPTS)
        # data.train: a per-epoch shuffled stream (data.py); (iteration, position) the run continues from
        self.offline = bool(pair_rows)  # the stream visits pairs, and no rollout runs
        data_rows = train_rows or pair_rows
        self.stream = PromptStream(data_rows, c.train.seed) if data_rows else None
        self.prepare_prompts([*(data_rows or [PromptRow(p) for p in self.prompts]), *eval_rows, *eval_pair_rows])
        self.data_base = (0, 0)
        self.out_dir = Path(c.train.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.start_iteration = 0
        self.log = RunLog(self.out_dir, self.rank, tuple(c.train.loggers), c.train.wandb_project)
        self._gather_once: bool | None = None  # rollout.gather_params, decided at the first rollout
        self.pending: Sampled | None = None  # update.lag: the rollout the next iteration trains on
        self._update_gather: bool | None = None  # update.gather_params, decided at the first update
        self.ledger = CommLedger()  # every collective of an iteration, by phase and kind (ledger.py)
        self.clock = PhaseClock(self.engine.device)  # each phase's time: metrics phase_seconds/<phase> (timing.py)
        self.evaluator = Evaluator(
            config=c,
            engine=self.engine,
            adapter=self.adapter,
            schedule=self.schedule,
            prompts=self.prompt_encoder,
            scorer=self.scorer,
            weights=self.weight_holder,
            decoder=self.decoder,
            rank=self.rank,
            audio_decoder=self.audio_decoder,
            out_dir=self.out_dir,
            eval_rows=eval_rows,
            sample_rows=eval_rows or train_rows or [PromptRow(p) for p in self.prompts],
        )
        self.algorithm.attach(self.engine)  # what it keeps beside the model (DiffusionNFT: the old policy)

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.log.history

    @property
    def reward(self) -> Reward | None:
        """A callable ``(latents, prompts) -> [B]`` that replaces the configured rewards (None: theirs)."""
        return self.scorer.override

    @reward.setter
    def reward(self, fn: Reward | None) -> None:
        self.scorer.override = fn

    def prepare_prompts(self, rows: list[PromptRow]) -> None:
        """Encode the run's prompt set up front where asked: ``text.offload: after_cache`` (then the text encoders
        leave the GPU), or a compiled model (every batch's text then takes the longest prompt's length bucket:
        one text shape, one graph per block class and phase)."""
        c = self.config
        if c.text.offload == "never" and c.train.compile == "off":
            return
        if self.conditioner is not None and c.text.offload != "never":
            raise ConfigError(
                f"text.offload={c.text.offload} moves the text encoders off the device once the prompt set is encoded, "
                "but an image-conditioned pipeline encodes each row (a prompt with its images) when a batch first "
                "draws it; fix: text.offload=never (each row is still encoded once: text.cache_mb)"
            )
        sp = self.engine.sp_size
        bucket = (lambda n: length_bucket(n, sp)) if c.train.compile != "off" else (lambda n: 0)
        self.prompt_encoder.prepare([r.prompt for r in rows], bucket)
        if c.text.offload == "after_cache":
            self.text_encoder.offload()

    # ---------------------------------------------------------------------------------------- one iteration

    def train_iteration(self, iteration: int, drain: bool = False) -> dict[str, Any]:
        """One iteration: its batch rolled out, scored and trained on; with ``update.lag: 1`` the previous
        iteration's rollout is trained on instead while this one's is scored, and ``drain`` trains this one's too
        (before a checkpoint and at the end: no rollout is left untrained, none is carried over a resume)."""
        start, encoding = time.perf_counter(), self.prompt_encoder.seconds
        with self.clock("batch"):  # prompts encoded (or their cache read), noise drawn, broadcast over SP
            batch = self.iteration_batch(iteration).prepared(self.engine)
        if self.config.update.lag:
            metrics = self.lagged_iteration(batch, drain)
        else:
            traj, advantages, old_log_probs, stats = self.collect(batch)
            metrics = self.train_on(batch, traj, advantages, old_log_probs, stats)
        if self.stream is not None:
            metrics["epoch"] = self.data_position(iteration + 1) / len(self.stream)
        metrics["iteration"] = iteration + 1
        metrics.update(self.clock.take())  # after the update's metrics were read: no extra wait on a GPU
        metrics["seconds"] = time.perf_counter() - start
        metrics["text_encode_seconds"] = self.prompt_encoder.seconds - encoding
        return metrics

    def iteration_batch(self, iteration: int) -> IterationBatch:
        """Prompts, their ragged conditioning, the initial noise and the algorithm's plan for this DP rank (the
        same on SP peers), on the host: ``.prepared(engine)`` makes it dense and puts it on the device."""
        g = self.config.flowgrpo
        gen = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, self.engine.dp_rank))
        if self.stream is not None:
            start = self.data_position(iteration) + self.engine.dp_rank * g.prompts_per_rank
            rows = self.stream.rows_at(start, g.prompts_per_rank)
        else:
            picks = torch.randint(len(self.prompts), (g.prompts_per_rank,), generator=gen).tolist()
            rows = [PromptRow(self.prompts[i]) for i in picks]
        group = 2 if self.offline else g.group_size  # offline: each row is a (chosen, rejected) pair
        cond, sources = self.prompt_encoder.encode(rows, group)
        first_group = self.engine.dp_rank * g.prompts_per_rank
        if self.offline:
            assert self.pair_latents is not None
            latents = self.pair_latents(rows)  # the pairs' data, where a rollout starts from noise
        else:
            latents = torch.randn(self.adapter.latent_shape(len(rows) * group), generator=gen)
        batch = IterationBatch(
            prompts=[r.prompt for r in rows for _ in range(group)],
            metadata=[r.metadata for r in rows for _ in range(group)],
            cond=cond,
            group_ids=torch.arange(first_group, first_group + len(rows)).repeat_interleave(group),
            latents=latents,
            source_pixels=sources,
        )
        # its window, its trained steps (algorithms/); what moves with training (MixGRPO's window) from a generator
        # seeded by the iteration alone: the same on every rank
        shared = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, 0x31))
        self.algorithm.plan(batch, gen, iteration, shared)
        batch.sde_seed = int(torch.randint(2**62, (1,), generator=gen))
        batch.shuffle_seed = int(torch.randint(2**62, (1,), generator=gen))
        if isinstance(self.engine, ExpertEngines):  # every rank trains the same expert at a time
            gen = torch.Generator().manual_seed(_seed(self.config.train.seed, iteration, 0x2E))
            self.algorithm.share_plan(batch, set(self.engine.trainable_steps()), gen)
        return batch

    def data_position(self, iteration: int) -> int:
        """The stream position iteration ``iteration`` starts at (each takes dp x prompts_per_rank prompts)."""
        base_iteration, base_position = self.data_base
        per_iteration = self.engine.dp_size * self.config.flowgrpo.prompts_per_rank
        return base_position + (iteration - base_iteration) * per_iteration

    def collect(self, batch: IterationBatch) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
        """Rollout and old log-probs ``[B, T]`` (both on weights gathered once: ``rollout.gather_params``), then
        rewards and advantages ``[B]``, of a prepared batch. Where the loss reads the old policy's step means, they
        come from where the old log-probs come from: their recomputation, or the rollout itself. With
        ``rollout.chunks > 1`` the configured rewards score each chunk in the background (``rewards/overlap.py``)."""
        if self.offline:  # preference pairs: the batch's latents are the data, nothing samples or scores
            return self.pair_batch(batch)
        background = self.config.rollout.chunks > 1 and self.scorer.override is None
        with BackgroundScoring(self.scorer) if background else contextlib.nullcontext() as scoring:
            sampled = self.sample(batch, scoring)
            advantages, stats = self.scored(sampled)
        return sampled.traj, advantages, sampled.old_log_probs, stats

    def sample(self, batch: IterationBatch, scoring: BackgroundScoring | None = None) -> Sampled:
        """A prepared batch rolled out and its old policy recomputed (and, ``flowgrpo.kl_reward``, its KL to the
        reference); ``scoring`` scores it in the background: each chunk as it is done (``rollout.chunks``), else
        the whole rollout as soon as it is."""
        wants = self.algorithm.inputs()
        recompute = self.config.flowgrpo.recompute_old_log_probs
        kl_reward = self.config.flowgrpo.kl_reward > 0
        means = wants.old_means or kl_reward  # the per-step KL reads the sampling policy's step means too
        chunked = scoring if self.config.rollout.chunks > 1 else None
        kl = None
        with self.engine.eval_mode(), self.weight_holder() as hold:
            with self.clock("rollout"):
                traj = self.rollout(batch, hold, keep_means=means and not recompute, scoring=chunked)
            if scoring is not None and chunked is None:  # scored beside the old policy's recomputation
                scoring.submit(traj.final, batch.prompts, batch.metadata, batch.source_pixels)
            old_log_probs = traj.rollout_log_probs()
            if means and not recompute:
                traj.old_means, traj.means = traj.rollout_means(), None  # only the trained steps' are kept
            if recompute and (wants.old_log_probs or kl_reward):
                with comm_phase("old_log_probs"), self.clock("old_log_probs"):
                    old_log_probs, traj.old_means = self.recompute_old_policy(batch, traj, hold, means)
            if kl_reward:
                with comm_phase("reference"), self.clock("reference"):
                    kl = self.reference_kl(batch, traj, hold)
        return Sampled(batch, traj, old_log_probs.detach(), kl, scoring)

    def scored(self, sampled: Sampled) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages and reward statistics of a sampled batch: scored here, or the wait for its background
        scoring (``rollout.chunks``: the last chunk's; ``update.lag``: the whole rollout's, long done)."""
        scoring = sampled.scoring
        with self.engine.eval_mode(), comm_phase("reward"), self.clock("reward"):
            advantages, stats = self.advantages(sampled.batch, sampled.traj, scoring, sampled.kl)
        if scoring is not None:
            stats.update(reward_seconds=scoring.busy_seconds, reward_wait_seconds=scoring.wait_seconds)
        return advantages, stats

    def train_on(
        self,
        batch: IterationBatch,
        traj: Trajectory,
        advantages: torch.Tensor,
        old_log_probs: torch.Tensor,
        stats: dict[str, float],
    ) -> dict[str, Any]:
        """The update on a scored rollout, and the iteration's metrics of it."""
        with self.clock("update"):
            metrics = self.update(batch, traj, advantages, old_log_probs)
        metrics.update(self.algorithm.after_update(self.engine, metrics))  # DiffusionNFT's decay, GARDO's reset
        metrics.update(stats)
        metrics.update(self.algorithm.iteration_metrics(batch.plan))
        return metrics

    def lagged_iteration(self, batch: IterationBatch, drain: bool) -> dict[str, Any]:
        """``update.lag: 1``: this batch rolled out and handed to the background scoring, then the previous
        iteration's rollout (scored meanwhile) trained on: one optimizer step behind its samples, which the loss's
        clipped ratio to their recorded log-probs accounts for. The first iteration has nothing to train yet
        (``update_skipped``); ``drain`` trains this batch too (its metrics under ``drain/``)."""
        scoring = BackgroundScoring(self.scorer) if self.scorer.override is None else None
        try:
            sampled = self.sample(batch, scoring)
        except BaseException:
            if scoring is not None:
                scoring.close()
            raise
        previous, self.pending = self.pending, sampled
        metrics: dict[str, Any] = {"update_skipped": 1.0} if previous is None else self.train_pending(previous)
        if drain:
            self.pending = None
            metrics.update({f"drain/{k}": v for k, v in self.train_pending(sampled).items()})
        return metrics

    def train_pending(self, sampled: Sampled) -> dict[str, Any]:
        """A lagged rollout's scores awaited (its scoring thread stopped after), then the update on it."""
        try:
            advantages, stats = self.scored(sampled)
        finally:
            if sampled.scoring is not None:
                sampled.scoring.close()
        return self.train_on(sampled.batch, sampled.traj, advantages, sampled.old_log_probs, stats)

    def close_pending(self) -> None:
        """Stop the background scoring of a rollout left untrained (a run that stops on an error)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.scoring is not None:
            pending.scoring.close()

    def pair_batch(self, batch: IterationBatch) -> tuple[Trajectory, torch.Tensor, torch.Tensor, dict[str, float]]:
        """A batch of preference pairs as :meth:`collect` returns a rollout: the data as the trajectory's final
        latents, the pairs' labels (+1 chosen, -1 rejected) as advantages, every sample kept in its order."""
        traj = Trajectory.of_data(batch.latents)
        traj.train_steps, traj.noise_seed = batch.plan.train_steps, batch.plan.noise_seed
        n = len(batch)
        labels = to_device(torch.tensor([1.0, -1.0]).repeat(n // 2), batch.latents.device)
        batch.kept = torch.arange(n)
        return traj, labels, labels.new_zeros((n, 0)), {"pairs": float(n // 2 * self.engine.dp_size)}

    def evaluate_pairs(self) -> dict[str, float]:
        """The held-out pairs (``flowgrpo.dpo.eval_pairs``) under the policy, without a gradient: the implicit
        reward margin and accuracy, the loss, each pair at ``EVAL_PAIR_DRAWS`` noises and sigmas fixed for the run
        (every rank evaluates every pair: an SP group runs its forwards together)."""
        assert self.pair_latents is not None
        rows, g = self.eval_pair_rows, self.config.flowgrpo
        batch = IterationBatch(
            prompts=[r.prompt for r in rows for _ in range(2)],
            cond=self.prompt_encoder.encode(rows, 2)[0],
            group_ids=torch.arange(len(rows)).repeat_interleave(2),
            latents=self.pair_latents(rows),
        ).prepared(self.engine)
        traj = Trajectory.of_data(batch.latents)
        traj.train_steps = torch.zeros(len(batch), EVAL_PAIR_DRAWS, dtype=torch.long, device=batch.latents.device)
        traj.noise_seed = _seed(self.config.train.seed, 0xE7A1)
        ctx = StepContext(self.adapter, self.schedule, self.rule, self.config)
        sums: dict[str, Any] = {}
        share = 1.0 / (EVAL_PAIR_DRAWS * len(batch))
        with torch.no_grad(), self.engine.eval_mode(), self.engine.ema_weights(), comm_phase("eval"):
            for draw in range(EVAL_PAIR_DRAWS):  # each pair at several (noise, sigma): one draw is a noisy measure
                for micro in torch.arange(len(batch)).split(g.micro_batch_size):
                    idx = to_device(micro, batch.latents.device)
                    cond = batch.cond_of(micro)  # host indices (cond_of)
                    step = evaluate_trained_step(self.engine, self.algorithm, ctx, traj, draw, idx, cond)
                    _, metrics = self.algorithm.loss(step, Targets(idx.new_zeros(0)), 1.0)
                    for key in ("loss", "implicit_acc", "implicit_reward_margin"):
                        sums[key] = sums.get(key, 0.0) + metrics[key] * (micro.numel() * share)
        return {f"eval_pairs/{k}": v for k, v in fetch_scalars(sums).items()}

    def rollout(
        self,
        batch: IterationBatch,
        hold: WeightHolder,
        keep_means: bool = False,
        scoring: BackgroundScoring | None = None,
    ) -> Trajectory:
        """The denoising run of a prepared batch with the algorithm's span by its rollout policy, each step's engine
        through ``hold``; ``keep_means``: the span's step means stored too; ``scoring``: the run in
        ``rollout.chunks`` pieces, each handed to it as it is done."""
        g, algorithm, plan = self.config.flowgrpo, self.algorithm, batch.plan
        engine = algorithm.rollout_engine(self.engine)
        sampler = Sampler(engine, self.adapter, self.schedule, g.cfg_scale, self.config.rollout.cfg_batch, hold)
        generator = torch.Generator().manual_seed(batch.sde_seed)
        span = algorithm.span(plan, self.schedule)
        final_is_prediction = algorithm.final_is_prediction
        with comm_phase("rollout"):
            if scoring is None:
                traj = denoise(sampler, batch.cond, batch.latents, span, generator, keep_means, final_is_prediction)
            else:

                def score(rows: slice, piece: Trajectory) -> None:
                    sources = batch.source_pixels[rows] if batch.source_pixels is not None else None
                    scoring.submit(piece.final, batch.prompts[rows], batch.metadata[rows], sources)

                traj = denoise_in_chunks(
                    sampler,
                    batch.cond_of,
                    batch.latents,
                    span,
                    generator,
                    self.config.rollout.chunks,
                    keep_means,
                    final_is_prediction,
                    on_chunk=score,
                )
        if plan.train_steps is not None:  # the algorithm's choice of steps (else the span's: its window)
            traj.train_steps, traj.host_steps = plan.train_steps, plan.host_steps
        traj.noise_seed = plan.noise_seed
        if self.engine.debug_checks:
            self.engine.verify_sp_consistency({"final_latents": traj.final}, "rollout")
        return traj

    def recompute_old_policy(
        self, batch: IterationBatch, traj: Trajectory, hold: WeightHolder, means: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([B, T], [B, T, ...] or None)``: each trained step's log-prob under the current policy and (``means``)
        its step mean, evaluated on the micro-batches the update's first pass trains (``update.micro_batches`` of
        every sample), so that the first optimizer step's forwards repeat these bit for bit: the on-policy ratio is
        exactly 1 (where the zero-advantage filter later drops samples the micro-batches differ: fp32 rounding)."""
        num_trained = traj.steps().shape[1]
        if num_trained == 0:
            return traj.rollout_log_probs(), None  # no trained step (an empty window): [B, 0]
        g = self.config.flowgrpo
        n = traj.latents.shape[0]
        log_probs: torch.Tensor | None = None
        step_means: torch.Tensor | None = None
        for mini in micro_batches(torch.arange(n), g.mini_batches, g.micro_batch_size, batch.shuffle_seed):
            for micro in mini:
                idx = to_device(micro, traj.latents.device)
                cond = batch.cond_of(micro)  # host indices (cond_of)
                for k in range(num_trained):
                    steps, latents, next_latents = traj.step_latents(idx, k)  # as the update reads them
                    engine = hold(route(self.engine, traj.host_step(k)))
                    sampler = Sampler(engine, self.adapter, self.schedule, g.cfg_scale, self.config.rollout.cfg_batch)
                    step = evaluate_step(sampler, latents, next_latents, steps, cond, self.rule)
                    if log_probs is None:
                        log_probs = step.log_prob.new_empty((n, num_trained))
                    log_probs[idx, k] = step.log_prob
                    if means:  # kept only when asked: T x the latents otherwise
                        if step_means is None:
                            shape = (n, num_trained, *step.prev_sample_mean.shape[1:])
                            step_means = step.prev_sample_mean.new_empty(shape)
                        step_means[idx, k] = step.prev_sample_mean
        assert log_probs is not None
        return log_probs, step_means

    def reference_kl(self, batch: IterationBatch, traj: Trajectory, hold: WeightHolder) -> torch.Tensor:
        """``[B, T]``: each trained step's KL between the sampling policy and the reference (adapters off) at the
        stored latents, ``mean_elems((mu - mu_ref)^2) / (2 s^2)`` with ``s = std_dev_t sqrt(-dt)`` (flow_grpo's
        ``kl_reward``), on the update's first micro-batches as the old log-probs are."""
        g = self.config.flowgrpo
        n, num_trained = traj.latents.shape[0], traj.steps().shape[1]
        kl = torch.zeros(n, num_trained, device=traj.latents.device)
        sigmas = self.schedule.on(traj.latents.device).sigmas
        for mini in micro_batches(torch.arange(n), g.mini_batches, g.micro_batch_size, batch.shuffle_seed):
            for micro in mini:
                idx = to_device(micro, traj.latents.device)
                cond = batch.cond_of(micro)  # host indices (cond_of)
                for k in range(num_trained):
                    steps, latents, next_latents = traj.step_latents(idx, k)
                    expert = route(self.engine, traj.host_step(k))
                    sampler = Sampler(hold(expert), self.adapter, self.schedule, g.cfg_scale, self.config.rollout.cfg_batch)
                    with expert.adapters_disabled():
                        ref = evaluate_step(sampler, latents, next_latents, steps, cond, self.rule)
                    s = ref.std_dev_t * torch.sqrt(sigmas[steps] - sigmas[steps + 1]).to(ref.std_dev_t.dtype)
                    sq = (traj.old_step_means(idx, k).to(ref.prev_sample_mean.dtype) - ref.prev_sample_mean) ** 2
                    kl[idx, k] = sq.mean(dim=tuple(range(1, sq.ndim))) / (2.0 * s**2)
        return kl

    def advantages(
        self,
        batch: IterationBatch,
        traj: Trajectory,
        scoring: BackgroundScoring | None = None,
        kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The rollout scored (or ``scoring``'s chunks gathered), the group-relative advantages ``[B]`` of this
        rank's samples (``[B, T]`` with the per-step ``kl``: flowgrpo.kl_reward), the reward statistics; with the
        zero-advantage filter, ``batch.kept`` (seeded from the batch: SP peers keep the same samples)."""
        g, engine = self.config.flowgrpo, self.engine
        scores = scoring.result() if scoring is not None else self.scorer(
            traj.final, batch.prompts, batch.metadata, batch.source_pixels
        )
        rewards, per_reward = scores.total, scores.each
        # rewards, advantages and their statistics stay on the device (read once, below)
        device = traj.latents.device
        all_groups = engine.gather_dp(to_device(batch.group_ids, device))
        table = engine.gather_dp(to_device(torch.stack([rewards, *per_reward.values()], dim=1), device))  # [B, 1 + R]
        all_rewards = table[:, 0].contiguous()
        features = engine.gather_dp(to_device(scores.features, device)) if scores.features is not None else None
        everyone = RewardTable(
            all_rewards, all_groups, {n: table[:, 1 + j].contiguous() for j, n in enumerate(per_reward)}, features
        )
        b = rewards.shape[0]
        gate = self.algorithm.kl_rows(everyone)  # the samples a gated KL applies to (GARDO)
        batch.kl_rows = gate[engine.dp_rank * b : (engine.dp_rank + 1) * b] if gate is not None else None
        if kl is None:
            advantages_all = self.algorithm.advantages_of(everyone)
            per_sample = advantages_all
        else:  # one advantage per trained step; a sample is left out where every one of its steps' is 0
            all_kl = engine.gather_dp(kl)
            advantages_all = self.algorithm.step_advantages(all_rewards, all_kl, all_groups)
            per_sample = advantages_all.abs().sum(dim=1)
        advantages = advantages_all[engine.dp_rank * b : (engine.dp_rank + 1) * b]
        batch.kept = self.algorithm.kept(per_sample, engine.dp_rank, engine.dp_size, batch.shuffle_seed + 1)
        stats = {
            "reward_mean": all_rewards.mean(),
            "reward_std": all_rewards.std(correction=0),
            "zero_advantage_fraction": (per_sample == 0).double().mean(),
        }
        if kl is not None:
            stats["kl_to_reference"] = all_kl.mean()
        if gate is not None:
            stats["kl_gated_samples"] = gate.double().mean()
        if len(per_reward) > 1 or (per_reward and g.rewards):
            stats.update({f"reward/{name}": table[:, 1 + j].mean() for j, name in enumerate(per_reward)})
        return advantages, fetch_scalars(stats)

    def update(
        self, batch: IterationBatch, traj: Trajectory, advantages: torch.Tensor, old_log_probs: torch.Tensor
    ) -> dict[str, float]:
        """The policy update on one rollout (``update.policy_update``), on ``batch.kept`` where the zero-advantage
        filter chose some, else on every sample."""
        metrics = policy_update(
            self.engine,
            self.algorithm,
            StepContext(self.adapter, self.schedule, self.rule, self.config),
            traj,
            advantages,
            old_log_probs,
            batch.cond_of,
            batch.shuffle_seed,
            batch.kept,
            self._update_holds(),
            batch.kl_rows,
        )
        if metrics["trained_samples"] == 0:  # every advantage 0 on every rank: no step anywhere
            lr = self.engine.optimizer.param_groups[0]["lr"]
            zero = ("loss", "policy_loss", "kl", "ppo_kl", "clipfrac", "grad_norm")
            metrics.update({k: 0.0 for k in zero}, ratio_mean=1.0, ratio_std=0.0, lr=lr, step_skipped=1.0)
        return metrics

    def _pair_latents(self, vae: torch.nn.Module | None) -> PairLatents:
        """The encoder of preference images (``model.pipeline``'s VAE), at the size the run's latents decode to."""
        check_pair_family(self.config)  # model.kind is settled now
        if vae is None or self.decoder is None:
            raise ConfigError(
                "flowgrpo.dpo.pairs / eval_pairs: the images are encoded through model.pipeline's VAE, and this run "
                "has none; fix: model.pipeline=<the diffusers pipeline folder of this model>"
            )
        # what one sample decodes to: [1, 3, H, W], or [1, F, 3, H, W] for video
        decoded = self.decoder(torch.zeros(self.adapter.latent_shape(1))).shape[1:]
        size = tuple(int(n) for n in (*decoded[:-3], *decoded[-2:]))  # (H, W) or (F, H, W)
        encoder = PixelEncoder(vae, self.adapter, self.engine.device, self.config.flowgrpo.micro_batch_size)
        key = "flowgrpo.dpo.pairs" if self.config.flowgrpo.dpo.pairs else "flowgrpo.dpo.eval_pairs"
        encoded = tuple(encoder(torch.zeros(1, *decoded)).shape)
        if encoded != tuple(self.adapter.latent_shape(1)):  # e.g. a video VAE whose encoder chunks time otherwise
            raise ConfigError(
                f"{key}: model.pipeline's VAE decodes the run's latents {tuple(self.adapter.latent_shape(1))} to "
                f"{tuple(decoded)} pixels but encodes those to {encoded}; fix: a latent size whose round trip holds "
                "(model.frames: Wan's VAE encodes 1 + 4k frames)"
            )
        return PairLatents(encoder, size, key)

    # ----------------------------------------------------------------------------- where the weights live

    def weight_holder(self) -> WeightHolder:
        """Holds a rollout's weights gathered from its first forward to its end where ``rollout.gather_params``
        chose so (decided once per run, the same on every rank: ``guidance.gathers_once``)."""
        if self._gather_once is None:
            self._gather_once = gathers_once(self.config.rollout.gather_params, self.engine)
        return WeightHolder(self._gather_once)

    def _update_holds(self) -> bool:
        """``update.gather_params``, decided at the first update (after a rollout: its activations are freed), the
        same on every rank (``guidance.gathers_once``)."""
        if self._update_gather is None:
            self._update_gather = gathers_once(self.config.update.gather_params, self.engine)
        return self._update_gather

    # ------------------------------------------------------------------------------------------- loop

    def _check_resume(self) -> None:
        """Refuse, on every rank and before anything is written, a resume that would make the checkpoint's run
        another one: another algorithm, or its EMA dropped (``io/run_record.py``), unless ``train.reset_optimizer``."""
        c = self.config.train
        latest = self.engine.find_latest(self.ckpt_dir) if c.resume else None  # two experts: one root each
        if latest is None or c.reset_optimizer:
            return
        problem = resume_problem(read_record(latest), self.config, latest)
        if problem:
            raise ConfigError(problem)

    def _resume(self) -> None:
        latest = self.engine.find_latest  # two experts: one root each
        if not self.config.train.resume or latest(self.ckpt_dir) is None:
            return
        extra = self.engine.load_checkpoint(self.ckpt_dir)
        if self.config.train.reset_optimizer:
            self.engine.reset_optimizer()
            if self.rank == 0:
                was = extra.get("algorithm", "an unrecorded algorithm")
                print(
                    f"--reset-optimizer: {self.config.flowgrpo.algorithm} starts from the weights of "
                    f"{latest(self.ckpt_dir)} (trained with {was}) with a fresh optimizer state and LR schedule",
                    flush=True,
                )
        if extra.get("algorithm") == self.config.flowgrpo.algorithm:  # not another's (--reset-optimizer)
            self.algorithm.load_state(extra.get("algorithm_state", {}))
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
        extra = {"iteration": iteration, "data_position": self.data_position(iteration), **run_record(self.config)}
        extra["algorithm_state"] = self.algorithm.state()
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
        self._check_resume()
        agree(  # rank 0 starts the loggers; a W&B that does not start stops every rank with its one line
            self.log.open(self.config.to_dict()),
            "train.loggers",
            fix="check the network and the key (wandb login), or WANDB_MODE=offline (the run kept on disk; `wandb "
            "sync` uploads it later), or drop wandb from train.loggers",
        )
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
        try:
            self._loop()
        finally:
            self.close_pending()
        layout = self.engine.layout
        self.log.close(
            plot=c.plot,
            title=f"{self.out_dir.name}: {self.config.model.kind}, dp {layout.dp} x ring {layout.ring} x "
            f"ulysses {layout.ulysses}, {len(self.history)} iterations",
        )
        return self.history

    def _loop(self) -> None:
        c = self.config.train
        for it in range(self.start_iteration, c.iterations):
            saves = bool(c.save_every) and (it + 1) % c.save_every == 0 and it + 1 < c.iterations
            with self.ledger.recording():
                metrics = self.train_iteration(it, drain=saves or it + 1 == c.iterations)
                if c.eval_every and (it + 1) % c.eval_every == 0:
                    if self.config.data.eval:
                        metrics.update(self.evaluator.evaluate())
                    if self.eval_pair_rows:
                        metrics.update(self.evaluate_pairs())
                if c.sample_every and (it + 1) % c.sample_every == 0:
                    self.evaluator.write_samples(it + 1)
            metrics.update(
                as_metrics(self.ledger.take())
            )  # this rank's collectives, as metrics.jsonl keeps them
            metrics["rollout_gathered_once"] = float(bool(self._gather_once))
            metrics["update_gathered_once"] = float(bool(self._update_gather))
            if c.compile != "off":  # every graph dynamo compiled in this process so far
                metrics["compile_graphs"] = float(compiled_graphs())
            self.log.append(metrics)  # and the progress bar
            if saves:
                self.save(it + 1)
        self.save(c.iterations)
