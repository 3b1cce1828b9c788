"""FSDP2 + Ulysses SP on one device mesh, with the gradient contract made exact by the engine.

One mesh ``(dp, ring, ulysses)``: FSDP2 shards parameters over all ranks (or, under HSDP, within each of
``dp_replicate`` replica groups and replicates across them); the ranks of an SP group share one micro-batch
(and its noise and timesteps) and each computes the loss of the whole sequence from the gathered output, but
its parameter gradients only cover its own sequence shard. The correct reduction is therefore a SUM over the
SP group and a MEAN over DP. FSDP's reductions sum over all ``dp * sp`` ranks; the engine sets the divide
factor to ``dp`` so the result is exact without the user scaling anything (``engine/sharding.py``), and
metrics report the loss as computed (unscaled).

Batches: ``engine/batch.py``; checkpoints: ``engine/checkpoint.py``; settings: ``engine/settings.py``;
sharding (FSDP / HSDP meshes, the reduction): ``engine/sharding.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import collective_device, default_device, fetch_scalars, to_device, use_device
from ..parallel.ledger import comm_kind, comm_phase
from ..parallel.mesh import MeshError, ParallelDims
from . import batch as batches
from . import checkpoint as ckpt
from . import held_params, sharding
from .compiling import compile_model
from .consistency import SPDivergenceError, verify_sp_consistency
from .model_setup import add_lora, check_cp_plan, control_groups, materialize_everywhere
from .optim import average_replicated_grads, training_state
from .protocols import EngineLayout
from .settings import EngineSettings, LoraSettings, OptimSettings
from .step_agreement import StepError, agree_step, batch_size_of, unpack_loss
from .weights import WeightsError, on_meta

logger = logging.getLogger(__name__)

LossFn = Callable[["FSDPEngine", dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]

__all__ = ["EngineSettings", "FSDPEngine", "LoraSettings", "OptimSettings", "SPDivergenceError", "StepError"]


class FSDPEngine:
    """A diffusers transformer under FSDP2 and Ulysses sequence parallelism.

    ``FSDPEngine(model, settings)`` or ``FSDPEngine(model, ulysses_sequence_parallel_size=2, lora=...)``: keyword
    arguments are :class:`EngineSettings` fields and replace those of ``settings``.

    A model may arrive with its parameters on ``meta`` (built by ``sp_diffusers.engine.weights.meta_model``
    or under ``accelerate.init_empty_weights()``, buffers real). The engine then shards it first and
    materialises only this rank's shards on its device, filled from ``weights=`` (``EngineSettings.weights``):
    a safetensors folder or file (each rank reads only its rows, in the parameter's dtype), a state dict of
    full tensors, a callable ``init(model)``, or ``"empty"`` (allocated, values left as they are: tracing
    under ``FakeTensorMode`` with ``device="cpu"``, or a ``load_checkpoint`` that follows). A model with real
    parameters is never moved whole to the device before sharding: ``fully_shard`` moves each block as it
    shards it.

    Args:
        model: a diffusers transformer with a context-parallel plan (Qwen-Image, Flux, Wan, ...).
        settings: layout, optimizer, LoRA and execution options (:class:`EngineSettings`).
    """

    def __init__(
        self, model: torch.nn.Module, settings: EngineSettings | None = None, **changes: Any
    ) -> None:
        import sp_diffusers

        s = (settings or EngineSettings()).replace(**changes) if changes else settings or EngineSettings()
        self.settings = s
        distributed = dist.is_available() and dist.is_initialized()
        ulysses, ring, replicate = s.ulysses_sequence_parallel_size, s.ring_degree, s.dp_replicate
        if not distributed and ulysses != 1:
            raise MeshError(
                f"ulysses_sequence_parallel_size={ulysses} needs torch.distributed; "
                "fix: launch with torchrun and init_process_group first"
            )
        dims = ParallelDims.of_process_group(ulysses, ring, replicate)
        self.layout = EngineLayout(
            dims.world, dims.dp, ring, ulysses, dist.get_rank() if distributed else 0, replicate=replicate
        )

        sp_diffusers.install()
        self.device = torch.device(s.device) if s.device is not None else default_device()
        use_device(self.device)  # torch's object collectives read the current device: it must be ours
        self.mesh = dims.build_mesh(self.device.type) if distributed else None
        self.dp_group = self.sp_group = None
        if self.mesh is not None:
            self.layout.dp_rank = self.mesh.get_local_rank("dp")
            self.dp_group = self.mesh.get_group("dp")
            # the SP group spans ring x ulysses (one sequence); ranks ordered ring-major like diffusers' shards
            sp_mesh = self.mesh["ring", "ulysses"]._flatten("sp") if ring > 1 else self.mesh["ulysses"]
            self.sp_group = sp_mesh.get_group()
            self.layout.sp_rank = sp_mesh.get_local_rank()
        self.control_group, self.sp_control_group = (
            control_groups(dims, self.sp_group) if distributed else (None, None)
        )

        # Weights reach the device only as shards: a real model moves block by block inside fully_shard (each
        # block's full weights, then only its shard, stay there); a meta model is materialised shard by shard.
        self.sharded = bool(s.use_fsdp and distributed and dims.world > 1)
        meta = on_meta(model)
        if s.weights is not None and not meta:
            source = type(s.weights).__name__ if isinstance(s.weights, dict) else repr(s.weights)
            raise WeightsError(
                f"EngineSettings.weights={source} is for a model built on meta, and this model's parameters "
                "already hold values; fix: build the model with sp_diffusers.engine.weights.meta_model (or "
                "accelerate.init_empty_weights), or drop weights="
            )
        if not (self.sharded or meta):
            model = model.to(self.device)  # replicas: every rank holds the whole model anyway
        if s.lora is not None:
            add_lora(model, s.lora)
        check_cp_plan(model)
        # before the plan's hooks wrap the forwards: those hooks, FSDP2's and the scope's run eagerly around the
        # graphs, so every block of a class shares its graphs
        compile_model(model, s.compile, fullgraph=s.compile == "blocks" or not (s.use_fsdp and distributed))
        model.set_attention_backend(s.attention_backend)
        if dims.sp > 1:
            model.enable_parallelism(
                config=sp_diffusers.context_parallel_config(
                    ulysses_degree=ulysses, ring_degree=ring, mesh=self.mesh
                )
            )
            # The engine's inputs are broadcast from the SP group's first rank (prepare_batch) or made from
            # them by the same code on every rank, so their lengths agree by construction: the backend's
            # per-forward agreement (a collective and a host sync) is redundant. debug_checks checks every call.
            sp_diffusers.set_rank_agreement(model, "per_call" if s.debug_checks else "trusted")
        if s.activation_checkpointing:
            if not getattr(model, "_supports_gradient_checkpointing", False):
                raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
            model.enable_gradient_checkpointing()
        self.shard_mesh = None  # FSDP2's mesh: 1-D over every rank, or (replicate, shard) under HSDP
        precision = s.mixed_precision
        if s.frozen:  # nothing to keep in fp32 for: the shards are stored in the compute dtype
            model.requires_grad_(False)
            if precision == "bf16":
                model.to(torch.bfloat16)  # on meta this costs nothing: the values then load in bf16
            precision = None
        if self.sharded:
            self.shard_mesh = sharding.fully_shard_model(model, self.mesh, dims, precision)
        elif precision == "bf16":
            model.to(torch.bfloat16)  # on meta this costs nothing: the values then load in bf16
        if meta:
            materialize_everywhere(model, self.device, s.weights, s.lora, self.control_group)
        self.model = model
        self.trainable, self.optimizer, self.lr_scheduler, self.ema = training_state(model, s)
        if s.frozen:
            model.eval()
        self.global_step = 0

    @property
    def optim_settings(self) -> OptimSettings:
        return self.settings.optim

    @property
    def lora(self) -> LoraSettings | None:
        return self.settings.lora

    @property
    def debug_checks(self) -> bool:
        return self.settings.debug_checks

    # --------------------------------------------------------------------------------- public surface

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank

    @property
    def sp_size(self) -> int:
        return self.layout.ulysses * self.layout.ring

    @property
    def is_sp_src_rank(self) -> bool:
        """True on the first rank of each SP group: the one whose batch the group uses and that reports."""
        return self.layout.sp_rank == 0

    def sp_src_global_rank(self) -> int:
        if self.sp_group is None:
            return 0
        return dist.get_global_rank(self.sp_group, 0)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """The base model (LoRA adapters off): the KL reference when training adapters."""
        if self.lora is None:
            raise RuntimeError("adapters_disabled() needs LoRA; without LoRA keep a frozen reference copy")
        self.model.disable_adapters()
        try:
            yield
        finally:
            self.model.enable_adapters()

    def gathered_params(self, backward: bool = False) -> contextlib.AbstractContextManager:
        """Inside: parameters all-gathered once and held over every forward (a rollout) and, with ``backward``, over
        backwards too (an optimizer step's micro-steps); ``engine/held_params.py``."""
        return held_params.held(self.model, backward) if self.sharded else contextlib.nullcontext()

    def ema_step(self) -> None:
        """Move the parameters' moving average (``ema_decay``) at this optimizer step; nothing without one."""
        if self.ema is not None:
            self.ema.step(self.global_step)

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """Inside: the parameters hold their moving average (evaluation, samples); as they were without one."""
        if self.ema is None:
            yield
            return
        self.release_params()  # gathered copies would hold the trained values: only shards are swapped
        with self.ema.swapped():
            try:
                yield
            finally:
                self.release_params()

    def release_params(self) -> None:
        """Only the shards stay: every block and the root's own parameters resharded (``held_params.release``)."""
        if self.sharded:
            held_params.release(self.model)

    def gather_fits(self) -> bool:
        """Whether holding the whole model gathered (in the compute dtype) fits this device (``held_params.fits``)."""
        dtype = torch.bfloat16 if self.settings.mixed_precision == "bf16" else None
        return not self.sharded or held_params.fits(held_params.gathered_bytes(self.model, dtype), self.device)

    def gather_dp(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` of every data-parallel rank stacked along dim 0, rank-major (one all-gather; ``t`` itself at dp 1)."""
        if self.dp_group is None or self.dp_size == 1:
            return t
        mine = to_device(t, collective_device(self.dp_group))
        gathered = mine.new_empty((self.dp_size * mine.shape[0], *mine.shape[1:]))
        with comm_kind("data"):
            dist.all_gather_into_tensor(gathered, mine, group=self.dp_group)
        return to_device(gathered, t.device)

    def for_step(self, step: int) -> FSDPEngine:
        """The engine that runs schedule step ``step``: this one (a two-expert model picks one per step)."""
        return self

    @property
    def num_experts(self) -> int:
        """How many transformers take turns along the schedule (one here; Wan2.2-A14B's ``ExpertEngines``: two)."""
        return 1

    def forward(self, **inputs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The transformer's output for ``inputs`` (full sequence, gathered on every SP rank): its one tensor, or
        the tuple of a model with several outputs (LTX-2's video and audio; the family adapter joins them)."""
        out = self.model(**inputs, return_dict=False)
        return out[0] if len(out) == 1 else tuple(out)

    def broadcast_in_sp_group(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Every tensor (and list of tensors) as the SP group's first rank has it."""
        return batches.broadcast_in_sp_group(self, tensors)

    def prepare_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Dense, on-device, identical on every SP rank.

        Ragged ``prompt_embeds`` / ``prompt_embeds_mask`` (and the negative ones for CFG) are padded to the
        batch maximum (pad 0, mask False), and to a multiple of the SP degree when the settings'
        ``pad_text_to_degree`` asks for it: sequences of any length shard exactly, so that is an option, not
        a need. Then the SP group's first rank broadcasts the batch, so its peers cannot drift; with
        ``debug_checks`` a checksum verifies it.
        """
        with comm_phase("batch"):
            return batches.prepare_batch(self, batch)

    def verify_sp_consistency(self, tensors: dict[str, Any], what: str = "batch") -> None:
        """Raise ``SPDivergenceError`` when SP peers hold different values (cheap checksum, one collective)."""
        if self.sp_group is not None and self.sp_size > 1:
            verify_sp_consistency(tensors, self.sp_group, what)

    def verify_parameters(self) -> None:
        """Raise ``SPDivergenceError`` when SP peers hold different parameters (debug: gathers sharded ones)."""
        if self.sp_group is None or self.sp_size == 1:
            return
        full = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in self.model.named_parameters()
        }
        self.verify_sp_consistency(full, "parameters")

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(
        self,
        batch: dict[str, Any] | None,
        loss_fn: LossFn,
        loss_scale: float = 1.0,
        num_samples: int | None = None,
    ) -> dict[str, Any]:
        """``loss_fn(engine, batch) -> (loss, metrics)``; backward of ``loss * loss_scale``.

        ``num_samples``: how many samples this rank's loss averages over. When the data-parallel ranks hold
        different counts, each rank's loss is weighted by its share (``n_local * dp / n_total``), so the
        gradient is the mean over all samples, not a mean of per-rank means; None: equal counts.

        Before backward every rank learns whether any rank's ``loss_fn`` failed (one small all-gather), and
        then all raise: the failing rank its own exception, the others a ``StepError`` naming it. A loss_fn
        that fails before the model's forward on one rank only cannot be caught this way (its peers are
        already inside the forward's collectives): they fail at the process-group timeout, or at once under
        torchrun, which stops every rank when one exits.

        The returned metrics carry ``loss`` as computed (unscaled by SP, by ``loss_scale`` or by anything). They
        stay where ``loss_fn`` made them: one-element tensors come back detached, on the device (reading each
        one would stop the host until the GPU drains, once per metric per micro-step); read a step's worth at
        once with ``sp_diffusers.parallel.devices.fetch_scalars`` (``train_step`` and ``optimizer_step`` return floats).
        """
        self.model.train()
        loss, metrics, failure = None, {}, None
        with comm_phase("train_forward"):
            try:
                loss, metrics = unpack_loss(loss_fn(self, batch))
            except Exception as err:  # shared with every rank below, then re-raised
                failure = err
            weight = agree_step(self, failure, num_samples)
        with comm_phase("train_backward"):
            (loss * (loss_scale * weight)).backward()
        metrics = {
            k: (v.detach() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in metrics.items()
        }
        metrics.setdefault("loss", loss.detach())
        return metrics

    def dp_sample_weight(self, num_samples: int) -> float:
        """This rank's loss weight when data-parallel ranks hold different sample counts (see
        ``forward_backward``); 1.0 when they are equal."""
        return agree_step(self, None, num_samples)

    def optimizer_step(self, step_scheduler: bool = True) -> dict[str, float]:
        """Clip, step, schedule. A non-finite gradient norm skips the step on every rank (same norm everywhere).

        ``step_scheduler=False`` leaves the LR schedule to ``lr_scheduler_step()`` (verl steps it separately).
        The gradient norm is the step's one device-to-host read (the skip decision needs it on the host).
        """
        return self._step(fetch_scalars({"grad_norm": self._clip_grad_norm()}), step_scheduler)

    def _clip_grad_norm(self) -> torch.Tensor:
        with comm_phase("optimizer"):
            if not self.sharded and self.layout.world > 1:
                average_replicated_grads(self.trainable, self.layout.dp)
            max_norm = self.optim_settings.max_grad_norm
            norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm if max_norm > 0 else float("inf"))
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def _step(self, metrics: dict[str, Any], step_scheduler: bool) -> dict[str, Any]:
        """The update for ``metrics`` read on the host (``grad_norm`` a float); ``metrics`` with lr and skip."""
        grad_norm = metrics["grad_norm"]
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning(
                "non-finite gradient norm %s at step %d: skipping the update", grad_norm, self.global_step
            )
        else:
            self.optimizer.step()
            if step_scheduler:
                self.lr_scheduler.step()
            self.global_step += 1
        self.zero_grad()
        return {**metrics, "lr": self.optimizer.param_groups[0]["lr"], "step_skipped": float(skipped)}

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step (for ``optimizer_step(step_scheduler=False)``); the new LR."""
        self.lr_scheduler.step()
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn) -> dict[str, Any]:
        """zero_grad -> forward_backward -> optimizer_step; the metrics as floats, read in one transfer."""
        self.zero_grad()
        if self.debug_checks:
            self.verify_parameters()
        metrics = self.forward_backward(batch, loss_fn, num_samples=batch_size_of(batch))
        # the loss_fn's metrics and the gradient norm reach the host together: one transfer per step
        return self._step(
            fetch_scalars({**metrics, "grad_norm": self._clip_grad_norm()}), step_scheduler=True
        )

    # ---------------------------------------------------------------------------------- checkpoints

    def reset_optimizer(self) -> None:
        """AdamW's state and the LR schedule from step 0, the parameters (and their EMA) as they are: a resume that
        starts another algorithm from a checkpoint's weights (``train.reset_optimizer``)."""
        from .optim import lr_schedule

        self.optimizer.state.clear()
        self.lr_scheduler = lr_schedule(self.optimizer, self.settings.optim.warmup_steps)
        self.global_step = 0

    def save_checkpoint(
        self, root: str | os.PathLike, step: int | None = None, extra: dict | None = None
    ) -> Path:
        """Write ``root/step-XXXXXXXX`` atomically (tmp folder, then rename) and point ``latest`` at it."""
        with comm_phase("checkpoint"):
            return ckpt.save_checkpoint(self, root, step, extra)

    def find_latest(self, root: str | os.PathLike) -> Path | None:
        """The newest complete checkpoint under ``root`` (None: none yet)."""
        return ckpt.find_latest(root)

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load ``path`` (a step folder, or a root whose ``latest`` names one); returns ``extra``.

        Any ``(dp, ring, ulysses)`` layout loads, HSDP or not (DCP reshards); a checkpoint of another model or other LoRA
        settings is refused, naming the difference, before anything changes. The model, optimizer, LR
        scheduler, step and each rank's RNG come back exactly.
        """
        with comm_phase("checkpoint"):
            return ckpt.load_checkpoint(self, path)
