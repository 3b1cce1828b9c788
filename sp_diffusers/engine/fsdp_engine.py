"""FSDP2 + Ulysses SP on one device mesh, with the gradient contract made exact by the engine.

One mesh ``(dp, ring, ulysses)``: FSDP2 shards parameters over all ranks; the ranks of an SP group
share one micro-batch (and its noise and timesteps) and each computes the loss of the whole sequence
from the gathered output, but its parameter gradients only cover its own sequence shard. The correct
reduction is therefore a SUM over the SP group and a MEAN over DP. FSDP's reduce-scatter over all
``dp * sp`` ranks divides by ``dp * sp``; the engine sets the divide factor to ``dp`` so the result is
exact without the user scaling anything, and metrics report the loss as computed (unscaled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import MeshError, build_device_mesh, default_device_type, validate_degrees
from ..padding import pad_text_batch
from . import checkpoint as ckpt
from .consistency import SPDivergenceError, verify_sp_consistency

logger = logging.getLogger(__name__)

TEXT_KEYS = (
    ("prompt_embeds", "prompt_embeds_mask"),
    ("negative_prompt_embeds", "negative_prompt_embeds_mask"),
)
LossFn = Callable[["FSDPEngine", dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]

__all__ = ["FSDPEngine", "LoraSettings", "OptimSettings", "SPDivergenceError"]


@dataclass(frozen=True)
class OptimSettings:
    """AdamW with linear warmup; gradients clipped to ``max_grad_norm`` (<= 0: no clipping)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft) added before sharding; the base weights are frozen."""

    rank: int = 8
    alpha: float = 8.0
    target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    init: str | bool = "gaussian"  # peft's init_lora_weights
    adapter_name: str = "default"


@dataclass
class _Layout:
    world: int
    dp: int
    ring: int
    ulysses: int
    rank: int
    dp_rank: int = 0
    sp_rank: int = 0
    extra: dict = field(default_factory=dict)


class FSDPEngine:
    """A diffusers transformer under FSDP2 and Ulysses sequence parallelism.

    Args:
        model: a diffusers transformer with a context-parallel plan (Qwen-Image, Flux, Wan, ...).
        ulysses_sequence_parallel_size: the Ulysses degree (verl's flag name); 1 turns SP off.
        ring_degree: the ring dimension of Ulysses x Ring (USP): SP degree = ulysses x ring, heads need only
            divide the Ulysses degree.
        lora: add LoRA adapters before sharding and train only them.
        use_fsdp: shard with FSDP2 (``fully_shard``); False keeps replicas and all-reduces gradients.
        mixed_precision: ``"bf16"`` computes in bfloat16 with fp32 gradient reduction (FSDP only).
        activation_checkpointing: recompute block activations in backward (``enable_gradient_checkpointing``).
        debug_checks: verify with a checksum that SP peers see the same batch, and raise on divergence.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        ulysses_sequence_parallel_size: int = 1,
        ring_degree: int = 1,
        optim: OptimSettings | None = None,
        lora: LoraSettings | None = None,
        use_fsdp: bool = True,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        attention_backend: str = "ulysses_sdpa",
        debug_checks: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        import sp_diffusers

        self.optim_settings = optim or OptimSettings()
        self.lora = lora
        self.debug_checks = debug_checks
        self.use_fsdp = use_fsdp
        if mixed_precision not in (None, "bf16", "fp32"):
            raise ValueError(f"mixed_precision={mixed_precision!r}: choose None/'fp32' or 'bf16'")
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if not distributed and ulysses_sequence_parallel_size != 1:
            raise MeshError(
                f"ulysses_sequence_parallel_size={ulysses_sequence_parallel_size} needs torch.distributed; "
                "fix: launch with torchrun and init_process_group first"
            )
        dp = validate_degrees(world, ulysses_sequence_parallel_size, ring_degree)
        self.layout = _Layout(
            world, dp, ring_degree, ulysses_sequence_parallel_size, dist.get_rank() if distributed else 0
        )

        sp_diffusers.install()
        self.device = torch.device(device) if device is not None else self._default_device()
        self.mesh = (
            build_device_mesh(self.layout.ulysses, ring_degree, self.device.type) if distributed else None
        )
        if self.mesh is not None:
            self.layout.dp_rank = self.mesh.get_local_rank("dp")
        self.dp_group = self.mesh.get_group("dp") if self.mesh is not None else None
        self.sp_group = None
        if self.mesh is not None:
            # the SP group spans ring x ulysses (one sequence); ranks ordered ring-major like diffusers' shards
            sp_mesh = self.mesh["ring", "ulysses"]._flatten("sp") if ring_degree > 1 else self.mesh["ulysses"]
            self.sp_group = sp_mesh.get_group()
            self.layout.sp_rank = sp_mesh.get_local_rank()

        model = model.to(self.device)
        if lora is not None:
            self._add_lora(model, lora)
        self._check_cp_plan(model)
        model.set_attention_backend(attention_backend)
        if self.layout.ulysses * ring_degree > 1:
            model.enable_parallelism(
                config=sp_diffusers.context_parallel_config(
                    ulysses_degree=self.layout.ulysses, ring_degree=ring_degree, mesh=self.mesh
                )
            )
        if activation_checkpointing:
            if not getattr(model, "_supports_gradient_checkpointing", False):
                raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
            model.enable_gradient_checkpointing()
        self.sharded = bool(use_fsdp and distributed and world > 1)
        if self.sharded:
            self._fully_shard(model, mixed_precision)
        elif mixed_precision == "bf16":
            model.to(torch.bfloat16)
        self.model = model
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no trainable parameters")
        o = self.optim_settings
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        warmup = max(0, o.warmup_steps)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.global_step = 0

    # ----------------------------------------------------------------------------------- setup helpers

    @staticmethod
    def _default_device() -> torch.device:
        if default_device_type() == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        return torch.device("cpu")

    @staticmethod
    def _check_cp_plan(model: torch.nn.Module) -> None:
        if getattr(model, "_cp_plan", None) is None:
            raise ValueError(
                f"{type(model).__name__} has no context-parallel plan (_cp_plan), so its sequence cannot be "
                "sharded; fix: use a model with a plan (Qwen-Image, Flux, Wan, LTX, ...) or set model._cp_plan"
            )

    @staticmethod
    def _add_lora(model: torch.nn.Module, lora: LoraSettings) -> None:
        try:
            from peft import LoraConfig
        except ImportError as err:  # pragma: no cover - peft is in the [train] extra
            raise ImportError("LoRA needs peft: pip install 'sp-diffusers[train]'") from err
        model.requires_grad_(False)
        model.add_adapter(
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                target_modules=list(lora.target_modules),
                init_lora_weights=lora.init,
            ),
            adapter_name=lora.adapter_name,
        )

    def _fully_shard(self, model: torch.nn.Module, mixed_precision: str | None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        flat = self.mesh["dp", "ring", "ulysses"]._flatten("fsdp")
        kwargs: dict[str, Any] = {"mesh": flat}
        if mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for child in model.children():
            if isinstance(child, torch.nn.ModuleList):
                for block in child:
                    fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        # The gradient contract: reduce-scatter sums over dp * sp ranks; dividing by dp (not dp * sp)
        # makes it SUM over the SP group and MEAN over data parallelism.
        # gloo has neither PREMUL_SUM nor AVG: reduce with SUM and let FSDP scale before/after.
        sum_only = dist.get_backend() == "gloo"
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(float(self.layout.dp))
                module.set_force_sum_reduction_for_comms(sum_only)

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

    def forward(self, **inputs: Any) -> torch.Tensor:
        """The transformer's output for ``inputs`` (full sequence, gathered on every SP rank)."""
        return self.model(**inputs, return_dict=False)[0]

    def broadcast_in_sp_group(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Every tensor (and list of tensors) as the SP group's first rank has it."""
        if self.sp_group is None or self.sp_size == 1:
            return tensors
        src = self.sp_src_global_rank()
        meta = [{k: _describe(v) for k, v in tensors.items()}]
        dist.broadcast_object_list(meta, src=src, group=self.sp_group)
        out: dict[str, Any] = {}
        for key, desc in meta[0].items():
            out[key] = _broadcast_value(tensors.get(key), desc, src, self.sp_group, self.device)
        return out

    def prepare_batch(
        self, batch: dict[str, Any], image_keys: tuple[str, ...] = ("latents",)
    ) -> dict[str, Any]:
        """Dense, SP-aligned, on-device, identical on every SP rank.

        Ragged ``prompt_embeds`` / ``prompt_embeds_mask`` (and the negative ones for CFG) are padded to
        the batch maximum and then to a multiple of the SP degree (pad 0, mask False). Image/video token
        counts (``image_keys``, ``[B, L, C]``) must divide the SP degree. Then the SP group's first rank
        broadcasts the batch, so its peers cannot drift; with ``debug_checks`` a checksum verifies it.
        """
        out = dict(batch)
        for emb_key, mask_key in TEXT_KEYS:
            if emb_key in out and out[emb_key] is not None:
                out[emb_key], out[mask_key] = pad_text_batch(
                    out[emb_key], out.get(mask_key), self.sp_size, emb_key
                )
        for key in image_keys:
            value = out.get(key)
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] % self.sp_size:
                raise ValueError(
                    f"{key} has {value.shape[1]} tokens, not divisible by the SP degree {self.sp_size}; fix: "
                    f"choose an image/video size whose token count is a multiple of {self.sp_size}, or lower "
                    "ulysses_sequence_parallel_size"
                )
        out = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in out.items()}
        if self.debug_checks:
            self.verify_sp_consistency(out, "batch (before broadcast)")
        return self.broadcast_in_sp_group(out)

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
        self.optimizer.zero_grad(set_to_none=True)

    def forward_backward(
        self, batch: dict[str, Any], loss_fn: LossFn, loss_scale: float = 1.0
    ) -> dict[str, Any]:
        """``loss_fn(engine, batch) -> (loss, metrics)``; backward of ``loss * loss_scale``.

        The returned metrics carry ``loss`` as computed (unscaled by SP, by ``loss_scale`` or by anything).
        """
        self.model.train()
        loss, metrics = loss_fn(self, batch)
        (loss * loss_scale).backward()
        metrics = {
            k: (v.detach().item() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in metrics.items()
        }
        metrics.setdefault("loss", loss.detach().item())
        return metrics

    def _sync_replicated_grads(self) -> None:
        if self.sharded or self.layout.world == 1:
            return
        for p in self.trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad.div_(self.layout.dp)

    def optimizer_step(self, step_scheduler: bool = True) -> dict[str, float]:
        """Clip, step, schedule. A non-finite gradient norm skips the step on every rank (same norm everywhere).

        ``step_scheduler=False`` leaves the LR schedule to ``lr_scheduler_step()`` (verl steps it separately).
        """
        self._sync_replicated_grads()
        max_norm = self.optim_settings.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm if max_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        skipped = not torch.isfinite(torch.tensor(grad_norm)).item()
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
        return {
            "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_skipped": float(skipped),
        }

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step (for ``optimizer_step(step_scheduler=False)``); the new LR."""
        self.lr_scheduler.step()
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, batch: dict[str, Any], loss_fn: LossFn) -> dict[str, Any]:
        """zero_grad -> forward_backward -> optimizer_step."""
        self.zero_grad()
        if self.debug_checks:
            self.verify_parameters()
        metrics = self.forward_backward(batch, loss_fn)
        metrics.update(self.optimizer_step())
        return metrics

    # ---------------------------------------------------------------------------------- checkpoints

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions())
        return {"model": model_sd, "optimizer": optim_sd}

    def _meta(self, step: int) -> ckpt.CheckpointMeta:
        return ckpt.CheckpointMeta(
            step=step,
            dp=self.layout.dp,
            ring=self.layout.ring,
            ulysses=self.layout.ulysses,
            model_class=type(self.model).__name__.removeprefix("FSDP"),
            model_fingerprint=ckpt.model_fingerprint(self.model),
            lora=self.lora is not None,
        )

    def save_checkpoint(
        self, root: str | os.PathLike, step: int | None = None, extra: dict | None = None
    ) -> Path:
        """Write ``root/step-XXXXXXXX`` atomically (tmp folder, then rename) and point ``latest`` at it."""
        import torch.distributed.checkpoint as dcp

        step = self.global_step if step is None else step
        root = Path(root)
        final = ckpt.checkpoint_dir_for(root, step)
        tmp = root / f"{ckpt.TMP_PREFIX}{final.name}"
        if self.layout.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            ckpt.remove_stale_tmp(root)
            tmp.mkdir(parents=True)
        ckpt.barrier()
        dcp.save(self._state(), checkpoint_id=str(tmp), no_dist=self.layout.world == 1)
        torch.save(ckpt.rng_state(), tmp / f"rng-rank{self.layout.rank:05d}.pt")
        if self.layout.rank == 0:
            torch.save(
                {
                    "lr_scheduler": self.lr_scheduler.state_dict(),
                    "global_step": self.global_step,
                    "extra": extra or {},
                },
                tmp / "trainer.pt",
            )
        ckpt.barrier()
        if self.layout.rank == 0:
            # meta.json last: its presence marks a complete checkpoint, then the rename publishes it
            ckpt.write_meta(tmp, self._meta(step))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            ckpt.write_latest(root, final.name)
        ckpt.barrier()
        return final

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load ``path`` (a step folder, or a root whose ``latest`` names one); returns ``extra``.

        Refuses a checkpoint from another model, another SP/DP layout or with/without LoRA, naming the
        difference; the model, optimizer, LR scheduler, step and each rank's RNG come back exactly.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        path = Path(path)
        if not (path / ckpt.META).exists():
            latest = ckpt.find_latest(path)
            if latest is None:
                raise ckpt.CheckpointError(f"no checkpoint at {path} (no {ckpt.META} and no '{ckpt.LATEST}')")
            path = latest
        meta = ckpt.read_meta(path)
        mine = self._meta(meta.step)

        def layout(m: ckpt.CheckpointMeta) -> str:
            return f"dp={m.dp} x ring={m.ring} x ulysses={m.ulysses}"

        if layout(meta) != layout(mine):
            raise ckpt.CheckpointError(
                f"checkpoint {path} was written with layout {layout(meta)} but this run has {layout(mine)}; fix: "
                "resume with the layout (process count and ulysses_sequence_parallel_size) it was written with"
            )
        for field_name in ("model_class", "model_fingerprint", "lora"):
            theirs, ours = getattr(meta, field_name), getattr(mine, field_name)
            if theirs != ours:
                raise ckpt.CheckpointError(
                    f"checkpoint {path} has {field_name}={theirs!r} but this run has {field_name}={ours!r}; fix: "
                    "resume with the same model and layout the checkpoint was written with"
                )
        try:
            stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise ckpt.CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err
        # Loading replaces the optimizer state: start from none, so every parameter gets a placeholder to load
        # into (an engine that already stepped has no state for parameters that never had a gradient).
        self.zero_grad()
        self.optimizer.state.clear()
        state = self._state()
        missing = [k for k in state["model"] if f"model.{k}" not in stored]
        if missing:
            raise ckpt.CheckpointError(
                f"checkpoint {path} lacks {len(missing)} model tensors (e.g. {missing[:3]}); it was written for "
                "another model or is incomplete"
            )
        # A parameter that never had a gradient has no AdamW state in the checkpoint; the fresh optimizer
        # got a placeholder state from get_state_dict, which is dropped again so the optimizer is as saved.
        stateless = {
            fqn for fqn in state["optimizer"].get("state", {}) if f"optimizer.state.{fqn}.step" not in stored
        }
        try:
            dcp.load(
                state,
                checkpoint_id=str(path),
                planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
                no_dist=self.layout.world == 1,
            )
        except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise ckpt.CheckpointError(f"checkpoint {path} is corrupt or incomplete: {err}") from err
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(),
        )
        params = dict(self.model.named_parameters())
        for fqn in stateless:
            self.optimizer.state.pop(params[fqn], None)
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        self.lr_scheduler.load_state_dict(trainer["lr_scheduler"])
        self.global_step = int(trainer["global_step"])
        rng_file = path / f"rng-rank{self.layout.rank:05d}.pt"
        if rng_file.exists():
            ckpt.set_rng_state(torch.load(rng_file, weights_only=False))
        ckpt.barrier()
        return trainer.get("extra", {})


def _describe(value: Any) -> Any:
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)) and value and all(torch.is_tensor(v) for v in value):
        return ("tensors", [(tuple(v.shape), v.dtype) for v in value])
    return ("object", value)


def _broadcast_value(value: Any, desc: Any, src: int, group, device: torch.device) -> Any:
    kind = desc[0]
    if kind == "object":
        return desc[1]
    if kind == "tensor":
        _, shape, dtype = desc
        t = (
            value
            if torch.is_tensor(value) and dist.get_rank() == src
            else torch.empty(shape, dtype=dtype, device=device)
        )
        t = t.contiguous()
        dist.broadcast(t, src=src, group=group)
        return t
    items = []
    for i, (shape, dtype) in enumerate(desc[1]):
        t = (
            value[i].contiguous()
            if dist.get_rank() == src
            else torch.empty(shape, dtype=dtype, device=device)
        )
        dist.broadcast(t, src=src, group=group)
        items.append(t)
    return items
