"""sp-diffusers as a verl engine: ``actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2``
turns on exact Ulysses SP for a diffusers transformer under FSDP2.

``SPDiffusersEngine`` is a verl ``BaseEngine`` that delegates everything to one ``sp_diffusers.FSDPEngine``
(mesh, sharding, the SP gradient contract, batches, optimizer, checkpoints): there is no second engine.
It is registered with verl's ``EngineRegistry`` for backends ``fsdp`` and ``fsdp2`` (both mean FSDP2
``fully_shard`` here) on devices cuda, npu and cpu, under ``MODEL_TYPE`` ("sp_diffusers_diffusion") and,
when no other engine holds it, under verl-omni's "diffusion_model". Importing this module registers it;
so does ``import verl`` through the ``verl.plugins`` entry point. Built the way verl's workers build engines::

    engine = EngineRegistry.new(model_type="sp_diffusers_diffusion", backend=engine_config.strategy,
                                model_config=DiffusionModelConfig(path=...), engine_config=FSDPEngineConfig(
                                    strategy="fsdp2", ulysses_sequence_parallel_size=2),
                                optimizer_config=FSDPOptimizerConfig(lr=1e-4), checkpoint_config=CheckpointConfig())
    engine.initialize()
    out = engine.train_batch(data, loss_function)   # TensorDict [B, ...]; out["metrics"]

Only ``engine_config.ulysses_sequence_parallel_size`` turns SP on; dp = world / SP, SP ranks adjacent.

**Batches** (``forward_backward_batch``): a TensorDict ``[B, ...]`` with ``latents [B, L, C]`` (image/video
tokens; L must divide the SP degree), ``prompt_embeds`` (dense ``[B, T, D]`` with ``prompt_embeds_mask
[B, T]``, or a jagged nested tensor ``[B, T_i, D]``; padded to a multiple of the SP degree here), any other
argument of the transformer's ``forward`` by name (``timestep [B]``, ``img_shapes`` as a non-tensor list,
...) and whatever the loss reads. It is cut into micro-batches of ``micro_batch_size_per_gpu`` (non-tensor
entry, else the engine config's, else one); each micro-batch loss is weighted by its share of the local
batch, so the gradient is that of the local-batch mean and, through FSDP, the mean over data parallelism.

**Loss functions**: verl's keyword form ``loss_function(model_output={"model_pred": [B, L, C]}, data=batch,
dp_group=group) -> (loss, metrics)`` (one transformer call per micro-batch), or any sp-diffusers loss
``fn(engine, batch) -> (loss, metrics)`` wrapped with ``engine_loss(fn)`` (several calls: FlowGRPO window
steps, CFG, a KL reference with adapters off).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import verl  # noqa: F401  (the error below must name the extra, not a verl submodule)
except ImportError as err:
    raise ImportError(
        f"sp_diffusers.integrations.verl needs verl ({err}); fix: pip install 'sp-diffusers[verl]' "
        "(verl==0.9.1, installed next to your torch build without verl's extras)"
    ) from err

from .verl_cpu import register_cpu_platform, wants_cpu_platform

# verl resolves its platform when verl.workers.engine is imported; the CPU platform must exist by then.
if wants_cpu_platform():
    register_cpu_platform()

from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, EngineRegistry

from ..engine import FSDPEngine, LoraSettings, OptimSettings
from ..mesh import MeshError, validate_degrees

logger = logging.getLogger(__name__)

MODEL_TYPE = "sp_diffusers_diffusion"
SHARED_MODEL_TYPE = "diffusion_model"  # verl-omni's model type: taken only where nobody holds it
BACKENDS = ("fsdp", "fsdp2")
DEVICES = ("cuda", "npu", "cpu")
SHARED_OWNERS = ("verl_omni",)  # installed packages that register SHARED_MODEL_TYPE themselves
# batch key -> transformer forward argument (the names verl's diffusion data and our trainer use)
INPUT_NAMES = {
    "latents": "hidden_states",
    "prompt_embeds": "encoder_hidden_states",
    "prompt_embeds_mask": "encoder_hidden_states_mask",
}

__all__ = [
    "BACKENDS",
    "DEVICES",
    "MODEL_TYPE",
    "SHARED_MODEL_TYPE",
    "DiffusionModelConfig",
    "SPDiffusersEngine",
    "engine_loss",
    "fsdp_engine_via_verl",
    "register",
]


@dataclass
class DiffusionModelConfig:
    """The model side of the engine (verl's ``model_config``).

    One of: ``module`` (an already-built diffusers transformer), ``path`` (a ``save_pretrained`` transformer
    folder, or a pipeline folder with ``transformer/``), or ``tiny`` (an ``sp_diffusers.tiny`` kind, random
    weights: the embedded default). LoRA when ``lora_rank > 0``; ``lora["merge"]`` says what
    ``get_per_tensor_param`` sends to the rollout (see there). Other verl model configs with the same field
    names (``local_path``/``path``, ``lora_rank``, ``lora_alpha``, ``target_modules``, ...) work too.
    """

    path: str = ""
    subfolder: str | None = None  # None: "transformer" when <path>/transformer/config.json exists
    tiny: str = ""
    tiny_overrides: dict = field(default_factory=dict)
    seed: int = 0
    module: torch.nn.Module | None = field(default=None, repr=False)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = ("to_q", "to_k", "to_v", "to_out.0")
    lora_init_weights: str | bool = "gaussian"
    lora: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    attention_backend: str = "ulysses_sdpa"
    debug_checks: bool = False
    use_fsdp: bool = True
    device: str | None = None  # None: from verl's platform (cpu under VERL_PLATFORM=cpu, else cuda/npu)
    # Ulysses x Ring: verl's FSDPEngineConfig carries the Ulysses degree only (and refuses unknown keys),
    # so the ring degree rides here (actor_rollout_ref.model.ring_degree); SP degree = ulysses x ring.
    ring_degree: int = 1


def engine_loss(fn: Callable[[FSDPEngine, dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]) -> Callable:
    """Mark ``fn(engine, batch) -> (loss, metrics)`` (sp-diffusers' loss form) for ``forward_backward_batch``."""
    fn.__sp_diffusers_engine_loss__ = True
    return fn


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default) if config is not None else default
    return default if value is None else value


def _config_error(parameter: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{parameter}={value!r} is not supported by the sp-diffusers verl engine; fix: {fix}")


def _optim_settings(config: Any) -> OptimSettings:
    """verl's ``FSDPOptimizerConfig`` -> ``OptimSettings`` (AdamW, linear warmup, then constant)."""
    if config is None:
        return OptimSettings()
    name, impl = str(_get(config, "optimizer", "AdamW")), str(_get(config, "optimizer_impl", "torch.optim"))
    if name.lower() != "adamw" or impl != "torch.optim":
        raise _config_error(
            "actor_rollout_ref.actor.optim.optimizer",
            f"{impl}.{name}",
            "optimizer=AdamW, optimizer_impl=torch.optim",
        )
    schedule = _get(config, "lr_scheduler_type", "constant")
    if schedule != "constant":
        raise _config_error(
            "actor_rollout_ref.actor.optim.lr_scheduler_type", schedule, "lr_scheduler_type=constant"
        )
    warmup = int(_get(config, "lr_warmup_steps", -1))
    if warmup <= 0:
        total = int(_get(config, "total_training_steps", -1))
        warmup = int(float(_get(config, "lr_warmup_steps_ratio", 0.0)) * total) if total > 0 else 0
    override = dict(_get(config, "override_optimizer_config", {}) or {})
    eps = float(override.pop("eps", 1e-8))
    if override:
        raise _config_error(
            "actor_rollout_ref.actor.optim.override_optimizer_config",
            override,
            "only 'eps' can be overridden",
        )
    return OptimSettings(
        lr=float(config.lr),
        weight_decay=float(_get(config, "weight_decay", 0.0)),
        betas=tuple(float(b) for b in _get(config, "betas", (0.9, 0.999))),
        eps=eps,
        warmup_steps=warmup,
        max_grad_norm=float(_get(config, "clip_grad", 0.0)),
    )


def _mixed_precision(engine_config: Any) -> str | None:
    mp = _get(engine_config, "mixed_precision", None)
    if not mp:
        return None
    param = str(mp.get("param_dtype", "bf16")).lower()
    reduce = str(mp.get("reduce_dtype", "fp32")).lower()
    if reduce not in ("fp32", "float32"):
        raise _config_error(
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype", reduce, "reduce_dtype=fp32"
        )
    if param in ("bf16", "bfloat16"):
        return "bf16"
    if param in ("fp32", "float32"):
        return None
    raise _config_error(
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype", param, "param_dtype=bf16 or fp32"
    )


def _model_dtype(engine_config: Any) -> torch.dtype:
    name = str(_get(engine_config, "model_dtype", "fp32")).lower()
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if name not in table:
        raise _config_error(
            "actor_rollout_ref.actor.fsdp_config.model_dtype", name, "model_dtype=fp32 (or bf16)"
        )
    return table[name]


def _to_batch(data: TensorDict) -> dict[str, Any]:
    """A micro-batch TensorDict -> the dict FSDPEngine takes (ragged text as a list of ``[T_i, D]``)."""
    out: dict[str, Any] = {}
    for key in data.keys():  # noqa: SIM118  (iterating a TensorDict yields rows, not keys)
        value = data.get(key)
        if isinstance(value, NonTensorData):
            value = value.data
        elif isinstance(value, NonTensorStack):
            value = value.tolist()
        elif torch.is_tensor(value) and value.is_nested:
            value = list(value.unbind())
        out[key] = value
    return out


def _append(into: dict[str, list], metrics: dict[str, Any]) -> None:
    for key, value in metrics.items():
        into.setdefault(key, []).append(value)


class SPDiffusersEngine(BaseEngine):
    """verl's engine surface over one ``sp_diffusers.FSDPEngine`` (``self.fsdp`` after ``initialize()``).

    Args:
        model_config: ``DiffusionModelConfig`` (or a verl model config with the same field names).
        engine_config: verl's ``FSDPEngineConfig``; ``ulysses_sequence_parallel_size`` is the SP degree.
        optimizer_config: verl's ``FSDPOptimizerConfig`` (AdamW; ``clip_grad`` is the max grad norm).
        checkpoint_config: verl's ``CheckpointConfig`` (every checkpoint holds model, optimizer, extra).
    """

    def __init__(
        self,
        model_config: Any,
        engine_config: Any,
        optimizer_config: Any = None,
        checkpoint_config: Any = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode: str | None = None
        self.fsdp: FSDPEngine | None = None
        self._saved: list[Path] = []
        strategy = _get(engine_config, "strategy", "fsdp2")
        if strategy not in BACKENDS:
            raise _config_error("actor_rollout_ref.actor.strategy", strategy, "strategy=fsdp2 (or fsdp)")
        self.sp_size = _get(engine_config, "ulysses_sequence_parallel_size", 1)
        self.ring_degree = _get(model_config, "ring_degree", 1)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            self.dp_size = validate_degrees(self.world, self.sp_size, self.ring_degree)
        except MeshError as err:
            raise MeshError(
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size x "
                f"actor_rollout_ref.model.ring_degree: {err}"
            ) from err
        self.cp_size = self.sp_size * self.ring_degree  # ranks that share one sample
        fsdp_size = int(_get(engine_config, "fsdp_size", -1))
        if fsdp_size not in (-1, self.world):
            raise _config_error(
                "actor_rollout_ref.actor.fsdp_config.fsdp_size",
                fsdp_size,
                "fsdp_size=-1 (shard over all ranks)",
            )
        self._mixed_precision = _mixed_precision(engine_config)
        self._optim = _optim_settings(optimizer_config)

    # ---------------------------------------------------------------------------------------- build

    def _build_model(self) -> torch.nn.Module:
        cfg = self.model_config
        module = getattr(cfg, "module", None)
        if module is None:
            path = _get(cfg, "local_path", "") or _get(cfg, "path", "")
            if path:
                module = self._load_pretrained(str(path))
            elif _get(cfg, "tiny", ""):
                from ..tiny import tiny_model

                module = tiny_model(
                    cfg.tiny, seed=int(_get(cfg, "seed", 0)), **dict(_get(cfg, "tiny_overrides", {}))
                )
            else:
                raise ValueError(
                    "model_config has neither path nor tiny nor module; fix: set actor_rollout_ref.model.path to a "
                    "diffusers pipeline or transformer folder (save_pretrained)"
                )
        return module.to(_model_dtype(self.engine_config))

    def _load_pretrained(self, path: str) -> torch.nn.Module:
        from diffusers import AutoModel

        root = Path(path)
        subfolder = _get(self.model_config, "subfolder", None)
        if subfolder is None and (root / "transformer" / "config.json").exists():
            subfolder = "transformer"
        if not (root / (subfolder or "") / "config.json").exists():
            raise FileNotFoundError(
                f"actor_rollout_ref.model.path={path!r} has no {subfolder + '/' if subfolder else ''}config.json; "
                "fix: point it at a transformer folder written by save_pretrained or a pipeline folder"
            )
        return AutoModel.from_pretrained(path, subfolder=subfolder)

    def _lora(self) -> LoraSettings | None:
        rank = int(_get(self.model_config, "lora_rank", 0))
        if rank <= 0:
            return None
        targets = _get(self.model_config, "target_modules", LoraSettings.target_modules)
        return LoraSettings(
            rank=rank,
            alpha=float(_get(self.model_config, "lora_alpha", 16.0)),
            target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
            init=_get(self.model_config, "lora_init_weights", "gaussian"),
        )

    def _device(self) -> torch.device | None:
        explicit = _get(self.model_config, "device", None)
        if explicit:
            return torch.device(explicit)
        from verl.utils.device import get_device_name

        name = get_device_name()
        if name == "cpu":
            return torch.device("cpu")
        if name == "cuda":
            return None  # FSDPEngine's default: cuda:LOCAL_RANK, or the CPU on a host without CUDA
        return torch.device(name, int(os.environ.get("LOCAL_RANK", "0")))

    def initialize(self) -> None:
        """Build the model and the ``FSDPEngine`` (mesh, LoRA, backend, FSDP2, AdamW, LR schedule)."""
        if self.fsdp is not None:
            return
        self.fsdp = FSDPEngine(
            self._build_model(),
            ulysses_sequence_parallel_size=self.sp_size,
            ring_degree=self.ring_degree,
            optim=self._optim,
            lora=self._lora(),
            use_fsdp=bool(_get(self.model_config, "use_fsdp", True)),
            mixed_precision=self._mixed_precision,
            activation_checkpointing=bool(_get(self.model_config, "enable_gradient_checkpointing", False)),
            attention_backend=_get(self.model_config, "attention_backend", "ulysses_sdpa"),
            debug_checks=bool(_get(self.model_config, "debug_checks", False)),
            device=self._device(),
        )
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled)

    def _engine(self) -> FSDPEngine:
        if self.fsdp is None:
            raise RuntimeError("the engine is not built yet; fix: call engine.initialize() first")
        return self.fsdp

    # ------------------------------------------------------------------------------------ properties

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(_get(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(_get(self.engine_config, "optimizer_offload", False))

    def get_data_parallel_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        # (dp, ring, ulysses): the ranks sharing one sample are blocks of ulysses x ring adjacent ranks
        return self.fsdp.dp_rank if self.fsdp is not None else self.rank // self.cp_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._engine().dp_group

    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        return self._engine().sp_group

    def is_mp_src_rank_with_outputs(self) -> bool:
        """True on SP rank 0 of each group: the rank whose outputs and metrics verl collects."""
        return self.fsdp.is_sp_src_rank if self.fsdp is not None else self.rank % self.cp_size == 0

    # ----------------------------------------------------------------------------------------- modes

    @contextlib.contextmanager
    def train_mode(self, **kwargs: Any) -> Iterator[None]:
        """Model in train mode; with offload, parameters/optimizer on the device inside, on the CPU after."""
        engine = self._engine()
        self._switch("train", on_device=True, **kwargs)
        was_training = engine.model.training
        engine.model.train()
        try:
            yield
        finally:
            engine.model.train(was_training)
            self._switch("train", on_device=False, **kwargs)

    @contextlib.contextmanager
    def eval_mode(self, **kwargs: Any) -> Iterator[None]:
        """``FSDPEngine.eval_mode`` (eval, no grad); with param offload, parameters on the device inside."""
        engine = self._engine()
        self._switch("eval", on_device=True, **kwargs)
        try:
            with engine.eval_mode():
                yield
        finally:
            self._switch("eval", on_device=False, **kwargs)

    def _switch(self, mode: str, on_device: bool, **kwargs: Any) -> None:
        self.mode = mode if on_device else None
        if kwargs.get("disable_auto_offload", False):
            return
        params = self.is_param_offload_enabled
        optim = self.is_optimizer_offload_enabled and mode == "train"
        if params or optim:
            self.to(
                str(self._engine().device) if on_device else "cpu", model=params, optimizer=optim, grad=params
            )

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move parameters (FSDP2 shards) and/or AdamW state between the engine's device and the CPU."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        engine = self._engine()
        target = torch.device(device)
        if engine.device.type == "cpu":
            return  # already there
        if model:
            engine.model.to(target)
        if optimizer:
            for state in engine.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = value.to(target, non_blocking=True)

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """LoRA adapters off inside (the base model: verl's reference policy); a no-op without LoRA."""
        engine = self._engine()
        return engine.adapters_disabled() if engine.lora is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------ optimizer

    def optimizer_zero_grad(self) -> None:
        self._engine().zero_grad()

    def optimizer_step(self) -> float:
        """Clip and step (``FSDPEngine.optimizer_step``; the LR schedule is ``lr_scheduler_step``); grad norm."""
        return self._engine().optimizer_step(step_scheduler=False)["grad_norm"]

    def lr_scheduler_step(self) -> float:
        return self._engine().lr_scheduler_step()

    # ---------------------------------------------------------------------------------- forward/back

    def _model_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        engine = self._engine()
        params = inspect.signature(engine.model.forward).parameters
        inputs = {}
        for key, value in batch.items():
            name = INPUT_NAMES.get(key, key)
            if name in params and name != "return_dict" and name not in inputs:
                inputs[name] = value
        return inputs

    def _micro_batches(self, data: TensorDict) -> list[TensorDict]:
        n = len(data)
        size = tu.get_non_tensor_data(data, "micro_batch_size_per_gpu", None)
        size = int(size or _get(self.engine_config, "micro_batch_size_per_gpu", 0) or n)
        if size <= 0 or n % size:
            raise ValueError(
                f"micro_batch_size_per_gpu={size} does not divide the local batch of {n} samples; fix: choose a "
                f"divisor of {n} (or leave it unset for one micro-batch)"
            )
        return tu.chunk_tensordict(data, n // size) if n // size > 1 else [data]

    def forward_backward_batch(
        self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False
    ) -> dict[str, Any]:
        """Micro-batches -> ``FSDPEngine.prepare_batch`` -> loss -> backward (unless ``forward_only``).

        Returns ``{"model_output": {"model_pred": [B, L, C]} (forward_only or return_model_output),
        "loss": [per micro-batch], "metrics": {name: [per micro-batch]}}``, the same on every SP rank.
        """
        engine = self._engine()
        if not isinstance(data, TensorDict):
            raise TypeError(
                f"data is a {type(data).__name__}; fix: pass a TensorDict (verl.utils.tensordict_utils.get_tensordict)"
            )
        if loss_function is None and not forward_only:
            raise ValueError("loss_function=None needs forward_only=True (nothing to differentiate)")
        tu.assign_non_tensor(data, sp_size=self.sp_size, dp_size=self.dp_size)
        keep_output = forward_only or bool(tu.get_non_tensor_data(data, "return_model_output", False))
        own_form = bool(getattr(loss_function, "__sp_diffusers_engine_loss__", False))
        group = self.get_data_parallel_group()
        n = len(data)
        losses: list[float] = []
        metrics: dict[str, list] = {}
        outputs: dict[str, list[torch.Tensor]] = {}

        for micro in self._micro_batches(data):
            batch = engine.prepare_batch(_to_batch(micro))

            def loss_fn(eng: FSDPEngine, b: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
                if own_form:
                    return loss_function(eng, b)
                model_output = {"model_pred": eng.forward(**self._model_inputs(b))}
                if keep_output:
                    for key, value in model_output.items():
                        outputs.setdefault(key, []).append(value.detach())
                if loss_function is None:
                    return torch.zeros((), device=eng.device), {}
                return loss_function(model_output=model_output, data=b, dp_group=group)

            if forward_only:
                with torch.no_grad():
                    loss, m = loss_fn(engine, batch)
                m = {k: (v.item() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in m.items()}
                m.setdefault("loss", float(loss))
            else:
                # the micro-batch's share of the local batch: the summed gradients are the local-batch mean's
                m = engine.forward_backward(batch, loss_fn, loss_scale=len(micro) / n)
            losses.append(m["loss"])
            _append(metrics, m)
        model_output = {k: torch.cat(v) for k, v in outputs.items()}
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    # ----------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> Path:
        """``FSDPEngine.save_checkpoint(local_path, step=global_step)``: atomic ``<local_path>/step-N``.

        ``max_ckpt_to_keep`` keeps the newest N checkpoints this engine wrote (older ones are deleted).
        """
        if hdfs_path:
            raise _config_error("hdfs_path", hdfs_path, "save to a local or mounted path (hdfs_path=None)")
        path = self._engine().save_checkpoint(local_path, step=global_step, extra=kwargs.get("extra"))
        self._saved = [p for p in self._saved if p != path] + [path]
        if max_ckpt_to_keep and max_ckpt_to_keep > 0:
            while len(self._saved) > max_ckpt_to_keep:
                old = self._saved.pop(0)
                if self.rank == 0 and old.exists():
                    shutil.rmtree(old)
            if dist.is_initialized():
                dist.barrier()
        return path

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        """``FSDPEngine.load_checkpoint``: ``local_path`` is a step folder or a root with ``latest``; returns
        the ``extra`` dict. The local checkpoint is never deleted (``del_local_after_load`` is ignored)."""
        if hdfs_path:
            raise _config_error("hdfs_path", hdfs_path, "load from a local or mounted path (hdfs_path=None)")
        return self._engine().load_checkpoint(local_path)

    # ------------------------------------------------------------------------------- weight export

    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Generator[tuple[str, torch.Tensor], None, None], dict | None]:
        """Full (unsharded) tensors for the rollout's weight sync, and the peft config (None without LoRA).

        Every rank must consume the generator in step: each tensor is all-gathered from its FSDP shards.
        Without LoRA: every tensor of the state dict. With LoRA (verl's convention): ``lora.merge=True`` sends
        the merged weights ``W + (alpha / r) B A`` under the base names (no peft config); otherwise
        ``base_sync_done=False`` sends the base weights (``.base_layer`` dropped from names, adapters
        left out) and ``base_sync_done=True`` only the adapter weights (peft names, e.g.
        ``...to_q.lora_A.weight``), each with the peft config.
        """
        engine = self._engine()
        model = engine.model
        if engine.lora is None:
            return _full_tensors(model.state_dict().items()), None
        adapter = engine.lora.adapter_name
        peft_config = model.peft_config[adapter].to_dict()
        if dict(_get(self.model_config, "lora", {}) or {}).get("merge", False):
            return _merged_lora(model, adapter), None
        state = model.state_dict()
        if base_sync_done:
            marker = f".{adapter}."
            items = ((k.replace(marker, "."), v) for k, v in state.items() if "lora_" in k and marker in k)
        else:
            items = ((k.replace(".base_layer", ""), v) for k, v in state.items() if "lora_" not in k)
        return _full_tensors(items), peft_config


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _full_tensors(items: Any) -> Generator[tuple[str, torch.Tensor], None, None]:
    for name, value in items:
        yield name, _full(value)


def _merged_lora(model: torch.nn.Module, adapter: str) -> Generator[tuple[str, torch.Tensor], None, None]:
    layers = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and adapter in getattr(module, "lora_A", {})
    }
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        owner = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        tensor = _full(value)
        if owner in layers and key.endswith(".base_layer.weight"):
            layer = layers[owner]
            a = _full(layer.lora_A[adapter].weight).float()
            b = _full(layer.lora_B[adapter].weight).float()
            tensor = (tensor.float() + layer.scaling[adapter] * (b @ a)).to(tensor.dtype)
        yield key.replace(".base_layer", ""), tensor


# ----------------------------------------------------------------------------------------- registry


def _holder(model_type: str, backend: str, device: str) -> type | None:
    # EngineRegistry has no public lookup by (backend, device) that ignores the current platform
    return EngineRegistry._engines.get(model_type, {}).get(backend, {}).get(device)


def _is_ours(cls: type | None) -> bool:
    # by name, not identity: a reloaded module makes a new class object for the same engine
    return cls is not None and f"{cls.__module__}.{cls.__qualname__}" == (
        f"{SPDiffusersEngine.__module__}.{SPDiffusersEngine.__qualname__}"
    )


def register() -> dict[str, list[str]]:
    """Register ``SPDiffusersEngine`` with verl's ``EngineRegistry`` (idempotent); what is registered where.

    ``MODEL_TYPE`` for every backend x device; ``SHARED_MODEL_TYPE`` only when no other engine holds any of
    its keys and no package of ``SHARED_OWNERS`` (verl-omni) is installed to claim it later (verl asserts on
    duplicate keys, and a half-shared model type would pick engines by device).
    """
    import importlib.util

    report: dict[str, list[str]] = {MODEL_TYPE: [], SHARED_MODEL_TYPE: []}
    others = {
        f"{c.__module__}.{c.__qualname__}"
        for devices in EngineRegistry._engines.get(SHARED_MODEL_TYPE, {}).values()
        for c in devices.values()
        if not _is_ours(c)
    }
    # verl-omni registers "diffusion_model" from its own plugin, maybe after us: leave the key to it
    others |= {name for name in SHARED_OWNERS if importlib.util.find_spec(name) is not None}
    targets = [MODEL_TYPE] if others else [MODEL_TYPE, SHARED_MODEL_TYPE]
    if others:
        logger.info(
            "%s is held by %s; sp-diffusers registers as %s only", SHARED_MODEL_TYPE, others, MODEL_TYPE
        )
    for model_type in targets:
        for backend in BACKENDS:
            for device in DEVICES:
                holder = _holder(model_type, backend, device)
                if holder is None:
                    EngineRegistry.register(model_type=model_type, backend=backend, device=device)(
                        SPDiffusersEngine
                    )
                elif not _is_ours(holder):
                    raise RuntimeError(
                        f"EngineRegistry[{model_type!r}][{backend!r}][{device!r}] is held by {holder.__module__}."
                        f"{holder.__qualname__}; fix: uninstall the plugin that registers it under sp-diffusers' "
                        f"model type, or set VERL_USE_EXTERNAL_PLUGINS to the plugins you want"
                    )
                report[model_type].append(f"{backend}/{device}")
    return report


REGISTERED = register()


def fsdp_engine_via_verl(
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
) -> FSDPEngine:
    """``FSDPEngine(model, ...)`` with the same arguments, built through ``EngineRegistry.new``.

    The settings travel as verl configs (``FSDPEngineConfig``, ``FSDPOptimizerConfig``) and come back
    unchanged, so the FSDPEngine is the one a direct call would build; the verl engine is ``.verl_engine``.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    if lora is not None and lora.adapter_name != "default":
        raise _config_error("lora.adapter_name", lora.adapter_name, "adapter_name='default'")
    o = optim or OptimSettings()
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        ulysses_sequence_parallel_size=ulysses_sequence_parallel_size,
        mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"}
        if mixed_precision == "bf16"
        else None,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=o.betas,
        clip_grad=o.max_grad_norm,
        lr_warmup_steps=o.warmup_steps,
        override_optimizer_config={"eps": o.eps},
    )
    model_config = DiffusionModelConfig(
        module=model,
        lora_rank=lora.rank if lora else 0,
        lora_alpha=lora.alpha if lora else 16.0,
        target_modules=lora.target_modules if lora else DiffusionModelConfig.target_modules,
        lora_init_weights=lora.init if lora else "gaussian",
        enable_gradient_checkpointing=activation_checkpointing,
        attention_backend=attention_backend,
        debug_checks=debug_checks,
        use_fsdp=use_fsdp,
        device=str(device) if device is not None else None,
        ring_degree=ring_degree,
    )
    verl_engine = EngineRegistry.new(
        model_type=MODEL_TYPE,
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(),
    )
    verl_engine.initialize()
    engine = verl_engine.fsdp
    engine.verl_engine = verl_engine
    return engine
