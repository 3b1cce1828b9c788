"""``SPDiffusersEngine``: verl's ``BaseEngine`` over one ``sp_diffusers.FSDPEngine``.

Everything (mesh, sharding, the SP gradient contract, batches, optimizer, checkpoints) is the FSDPEngine's:
there is no second engine. This module adapts verl's surface: TensorDict batches cut into micro-batches,
verl's loss-function form, train/eval modes with offload, checkpoint naming and pruning, weight export.

**Batches** (``forward_backward_batch``): a TensorDict ``[B, ...]`` with ``latents [B, L, C]`` (image/video
tokens; L must divide the SP degree), ``prompt_embeds`` (dense ``[B, T, D]`` with ``prompt_embeds_mask
[B, T]``, or a jagged nested tensor ``[B, T_i, D]``; padded to a multiple of the SP degree here), any other
argument of the transformer's ``forward`` by name (``timestep [B]``, ``img_shapes`` as a non-tensor list,
...) and whatever the loss reads. It is cut into micro-batches of ``micro_batch_size_per_gpu`` (non-tensor
entry, else the engine config's, else one); each micro-batch loss is weighted by its share of the local
batch, so the gradient is that of the local-batch mean and, through FSDP, the mean over data parallelism.

**Loss functions**: verl's keyword form ``loss_function(model_output={"model_pred": [B, L, C]}, data=batch,
dp_group=group) -> (loss, metrics)`` (one transformer call per micro-batch; a model with several outputs, Z-Image's
per-sample list or LTX-2's video and audio, is refused there), or any sp-diffusers loss
``fn(engine, batch) -> (loss, metrics)`` wrapped with ``engine_loss(fn)`` (several calls: FlowGRPO window
steps, CFG, a KL reference with adapters off).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine

from ...engine import FSDPEngine
from ...parallel.devices import fetch_scalars
from .config import config_error, engine_settings, get_field, model_dtype, parallel_dims
from .weights import per_tensor_params

__all__ = ["INPUT_NAMES", "SPDiffusersEngine", "engine_loss"]

# batch key -> transformer forward argument (the names verl's diffusion data and our trainer use)
INPUT_NAMES = {
    "latents": "hidden_states",
    "prompt_embeds": "encoder_hidden_states",
    "prompt_embeds_mask": "encoder_hidden_states_mask",
}


def engine_loss(fn: Callable[[FSDPEngine, dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]) -> Callable:
    """Mark ``fn(engine, batch) -> (loss, metrics)`` (sp-diffusers' loss form) for ``forward_backward_batch``."""
    fn.__sp_diffusers_engine_loss__ = True
    return fn


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
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dims = parallel_dims(model_config, engine_config, self.world)
        self.sp_size, self.ring_degree = self.dims.ulysses, self.dims.ring
        self.dp_size = self.dims.dp
        self.cp_size = self.dims.sp  # ranks that share one sample
        # read (and validated) now, so a bad optimizer or precision setting fails before the model is built
        self.settings = engine_settings(model_config, engine_config, optimizer_config, world=self.world)

    # ---------------------------------------------------------------------------------------- build

    def _build_model(self) -> torch.nn.Module:
        cfg = self.model_config
        module = getattr(cfg, "module", None)
        if module is None:
            path = get_field(cfg, "local_path", "") or get_field(cfg, "path", "")
            if path:
                module = self._load_pretrained(str(path))
            elif get_field(cfg, "tiny", ""):
                from ...tiny import tiny_model

                module = tiny_model(
                    cfg.tiny,
                    seed=int(get_field(cfg, "seed", 0)),
                    **dict(get_field(cfg, "tiny_overrides", {})),
                )
            else:
                raise ValueError(
                    "model_config has neither path nor tiny nor module; fix: set actor_rollout_ref.model.path to a "
                    "diffusers pipeline or transformer folder (save_pretrained)"
                )
        return module.to(model_dtype(self.engine_config))  # a no-op for a model loaded in that dtype

    def _load_pretrained(self, path: str) -> torch.nn.Module:
        from diffusers import AutoModel

        root = Path(path)
        subfolder = get_field(self.model_config, "subfolder", None)
        if subfolder is None and (root / "transformer" / "config.json").exists():
            subfolder = "transformer"
        if not (root / (subfolder or "") / "config.json").exists():
            raise FileNotFoundError(
                f"actor_rollout_ref.model.path={path!r} has no {subfolder + '/' if subfolder else ''}config.json; "
                "fix: point it at a transformer folder written by save_pretrained or a pipeline folder"
            )
        # in the training dtype straight from the files: never a float32 copy of a bf16 checkpoint first
        return AutoModel.from_pretrained(
            path, subfolder=subfolder, torch_dtype=model_dtype(self.engine_config)
        )

    def _device(self) -> torch.device | None:
        explicit = get_field(self.model_config, "device", None)
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
        self.fsdp = FSDPEngine(self._build_model(), self.settings.replace(device=self._device()))
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled)

    def _engine(self) -> FSDPEngine:
        if self.fsdp is None:
            raise RuntimeError("the engine is not built yet; fix: call engine.initialize() first")
        return self.fsdp

    # ------------------------------------------------------------------------------------ properties

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(get_field(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(get_field(self.engine_config, "optimizer_offload", False))

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
        size = int(size or get_field(self.engine_config, "micro_batch_size_per_gpu", 0) or n)
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
                pred = eng.forward(**self._model_inputs(b))
                if not torch.is_tensor(pred):  # Z-Image's per-sample list, LTX-2's (video, audio)
                    raise ValueError(
                        f"{type(eng.model).__name__} returns {len(pred)} outputs ({type(pred).__name__}), and verl's "
                        "keyword loss form takes one model_pred tensor; fix: a loss fn(engine, batch) -> (loss, "
                        "metrics) wrapped with sp_diffusers.integrations.verl.engine_loss, which calls the model "
                        "and reads each output itself"
                    )
                model_output = {"model_pred": pred}
                if keep_output:
                    for key, value in model_output.items():
                        outputs.setdefault(key, []).append(value.detach())
                if loss_function is None:
                    return torch.zeros((), device=eng.device), {}
                return loss_function(model_output=model_output, data=b, dp_group=group)

            if forward_only:
                with torch.no_grad():
                    loss, m = loss_fn(engine, batch)
                m = {k: (v.detach() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in m.items()}
                m.setdefault("loss", loss.detach())
            else:
                # the micro-batch's share of the local batch: the summed gradients are the local-batch mean's;
                # num_samples weights data-parallel ranks that hold different counts by their share
                m = engine.forward_backward(batch, loss_fn, loss_scale=len(micro) / n, num_samples=n)
            losses.append(m["loss"])
            _append(metrics, m)
        # every micro-batch's metrics stayed on the device until here: one transfer for the whole batch
        metrics = fetch_scalars({**metrics, " losses": losses})
        losses = metrics.pop(" losses")
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
            raise config_error("hdfs_path", hdfs_path, "save to a local or mounted path (hdfs_path=None)")
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
            raise config_error("hdfs_path", hdfs_path, "load from a local or mounted path (hdfs_path=None)")
        return self._engine().load_checkpoint(local_path)

    # ------------------------------------------------------------------------------- weight export

    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Generator[tuple[str, torch.Tensor], None, None], dict | None]:
        """Full (unsharded) tensors for the rollout's weight sync, and the peft config (None without LoRA);
        ``model_config.lora["merge"]`` and ``base_sync_done`` choose what is sent (``weights.py``)."""
        merge = bool(dict(get_field(self.model_config, "lora", {}) or {}).get("merge", False))
        return per_tensor_params(self._engine(), merge=merge, base_sync_done=base_sync_done)
