"""The sp-diffusers verl engine on real gloo ranks, built through verl's ``EngineRegistry.new``.

Run with ``VERL_PLATFORM=cpu`` and ``VERL_USE_EXTERNAL_PLUGINS=none`` (set by the parent through
``run_distributed(env=...)``): the CPU platform is registered, then the plugin is imported. Each function
returns plain data; the parent asserts.
"""

from __future__ import annotations

import logging
import tempfile
import warnings

import torch
import torch.distributed as dist

from tests._parity import PARITY_EPS, PARITY_LR

G = 8  # global samples: 4 per dp rank at dp = 2, cut into micro-batches of 2
MICRO = 2
TEXT_LENGTHS = (5, 8, 3, 7, 6, 4, 9, 5)  # ragged, some odd: the engine pads them to the SP degree


def _plugin():
    """Register the CPU platform, then import the plugin (the order integrations.md prescribes)."""
    warnings.filterwarnings("ignore")
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    from sp_diffusers.integrations.verl.cpu import register_cpu_platform

    register_cpu_platform()
    import sp_diffusers.integrations.verl.plugin as plugin

    return plugin


def _engine(sp: int, lora: bool = False, ring: int = 1):
    plugin = _plugin()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    torch.manual_seed(1234)  # LoRA adapters draw their initial weights from the global RNG
    engine_config = FSDPEngineConfig(ulysses_sequence_parallel_size=sp, strategy="fsdp2")
    engine = EngineRegistry.new(
        model_type=plugin.MODEL_TYPE,
        backend=engine_config.strategy,
        model_config=plugin.DiffusionModelConfig(
            tiny="qwenimage",
            tiny_overrides={"num_layers": 2},
            lora_rank=4 if lora else 0,
            lora_alpha=8.0,
            lora_init_weights=False,  # random A and B: both get gradients at the first step
            ring_degree=ring,
        ),
        engine_config=engine_config,
        # no clipping and no weight decay: the step itself is compared, well-conditioned (tests/_parity.py)
        optimizer_config=FSDPOptimizerConfig(
            lr=PARITY_LR, clip_grad=1e9, weight_decay=0.0, override_optimizer_config={"eps": PARITY_EPS}
        ),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def _global_data(model) -> dict:
    g = torch.Generator().manual_seed(42)
    cfg = model.config
    tokens = 16  # 8 x 8 latent, patch 2
    out_dim = cfg.patch_size * cfg.patch_size * cfg.out_channels
    return {
        "latents": torch.randn(G, tokens, cfg.in_channels, generator=g),
        "prompt_embeds": [torch.randn(n, cfg.joint_attention_dim, generator=g) for n in TEXT_LENGTHS],
        "timestep": torch.rand(G, generator=g),
        "target": torch.randn(G, tokens, out_dim, generator=g),
    }


def _local_tensordict(engine, data: dict):
    """This dp rank's slice as verl hands it to a worker: a TensorDict, ragged text as a jagged tensor."""
    from verl.utils import tensordict_utils as tu

    dp, rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    n = G // dp
    sl = slice(rank * n, (rank + 1) * n)
    return tu.get_tensordict(
        {
            "latents": data["latents"][sl],
            "prompt_embeds": torch.nested.as_nested_tensor(data["prompt_embeds"][sl], layout=torch.jagged),
            "timestep": data["timestep"][sl],
            "target": data["target"][sl],
            "img_shapes": [[(1, 4, 4)]] * n,
        },
        {"micro_batch_size_per_gpu": MICRO},
    )


def mse_loss(model_output, data, dp_group=None):
    """verl's loss form: the micro-batch mean squared error of the velocity prediction."""
    loss = torch.nn.functional.mse_loss(model_output["model_pred"], data["target"])
    return loss, {"mse": loss.detach()}


def _mse_engine_form(engine, batch):
    from sp_diffusers.integrations.verl import INPUT_NAMES

    inputs = {INPUT_NAMES.get(k, k): batch[k] for k in ("latents", "prompt_embeds", "prompt_embeds_mask")}
    pred = engine.forward(**inputs, timestep=batch["timestep"], img_shapes=batch["img_shapes"])
    loss = torch.nn.functional.mse_loss(pred, batch["target"])
    return loss, {"mse": loss.detach()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


def _params(engine) -> dict:
    return {n: _full(p) for n, p in engine.fsdp.model.named_parameters() if p.requires_grad}


def _layout(engine) -> dict:
    dp_group, sp_group = engine.get_data_parallel_group(), engine.get_sequence_parallel_group()
    return {
        "rank": dist.get_rank(),
        "dp_size": engine.get_data_parallel_size(),
        "dp_rank": engine.get_data_parallel_rank(),
        "dp_group_ranks": dist.get_process_group_ranks(dp_group),
        "sp_group_ranks": dist.get_process_group_ranks(sp_group),
        "mesh": dict(zip(engine.fsdp.mesh.mesh_dim_names, engine.fsdp.mesh.mesh.shape, strict=True)),
        "src": engine.is_mp_src_rank_with_outputs(),
        "sp_rank": engine.fsdp.sp_rank,
    }


def _step(engine, data: dict) -> dict:
    td = _local_tensordict(engine, data)
    grads: dict = {}
    fsdp = engine.fsdp
    step = fsdp.optimizer_step

    def capture_then_step(*args, **kwargs):
        grads.update({n: _full(p.grad) for n, p in fsdp.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    fsdp.optimizer_step = capture_then_step
    try:
        with engine.train_mode():
            out = engine.train_batch(td, mse_loss)
    finally:
        del fsdp.optimizer_step
    lr = engine.lr_scheduler_step()
    return {
        "grads": grads,
        "losses": out["loss"],
        "mse": out["metrics"]["mse"],
        "grad_norm": out["metrics"].get("grad_norm"),
        "lr": lr,
        "params": _params(engine),
    }


def train_step(rank: int, world: int, sp: int, extras: bool, ring: int = 1) -> dict:
    """One ``train_batch`` (full fine-tuning; with ``extras`` also LoRA, inference, both loss forms,
    checkpoint save/resume and the rollout weight export) on this layout."""
    engine = _engine(sp, ring=ring)
    data = _global_data(engine.fsdp.model)
    result = {"layout": _layout(engine), "full": _step(engine, data)}
    if rank != 0:
        result["full"]["params"] = result["full"]["grads"] = None
    if not extras:
        return result

    # inference: verl's keyword loss and the sp-diffusers form compute the same numbers
    from sp_diffusers.integrations.verl import engine_loss

    with engine.eval_mode():
        inferred = engine.infer_batch(_local_tensordict(engine, data), mse_loss)
        own = engine.infer_batch(_local_tensordict(engine, data), engine_loss(_mse_engine_form))
    result["infer"] = {
        "model_pred": inferred["model_output"]["model_pred"].cpu(),
        "losses": inferred["loss"],
        "own_losses": own["loss"],
    }

    # checkpoint: save after step 1, take step 2, reload step 1, take step 2 again -> identical parameters;
    # then save step 2 keeping one checkpoint -> step 1 is deleted
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    first = engine.save_checkpoint(root[0], global_step=1, max_ckpt_to_keep=2)
    second_pass = _step(engine, data)["params"]
    engine.load_checkpoint(str(first))
    again = _step(engine, data)["params"]
    second = engine.save_checkpoint(root[0], global_step=2, max_ckpt_to_keep=1)
    result["ckpt"] = {
        "first_exists_after_prune": first.exists(),
        "second_exists": second.exists(),
        "resume_diff": max((second_pass[n] - again[n]).abs().max().item() for n in again),
    }

    lora_engine = _engine(sp, lora=True)
    result["lora"] = _step(lora_engine, data)
    if rank != 0:
        result["lora"]["params"] = result["lora"]["grads"] = None
    result["export"] = _export(lora_engine)

    # verl's reference policy: the LoRA engine with adapters off computes the base model (a fresh engine)
    with lora_engine.eval_mode(), lora_engine.disable_adapter():
        off = lora_engine.infer_batch(_local_tensordict(lora_engine, data), mse_loss)["model_output"]
    base_engine = _engine(sp)
    with base_engine.eval_mode():
        base = base_engine.infer_batch(_local_tensordict(base_engine, data), mse_loss)["model_output"]
    with lora_engine.eval_mode():
        on = lora_engine.infer_batch(_local_tensordict(lora_engine, data), mse_loss)["model_output"]
    result["adapters_off_diff"] = (off["model_pred"] - base["model_pred"]).abs().max().item()
    result["adapters_on_diff"] = (on["model_pred"] - base["model_pred"]).abs().max().item()
    return result


def _export(engine) -> dict:
    """The LoRA-aware rollout weight export: base, adapters only, merged."""
    base_gen, base_cfg = engine.get_per_tensor_param(base_sync_done=False)
    base = {k: v.clone() for k, v in base_gen}
    lora_gen, lora_cfg = engine.get_per_tensor_param(base_sync_done=True)
    adapters = {k: v.clone() for k, v in lora_gen}
    engine.model_config.lora = {"merge": True}
    merged_gen, merged_cfg = engine.get_per_tensor_param()
    merged = {k: v.clone() for k, v in merged_gen}
    engine.model_config.lora = {}
    return {
        "base": base,
        "adapters": adapters,
        "merged": merged,
        "peft_config": base_cfg,
        "adapter_peft_config": lora_cfg,
        "merged_peft_config": merged_cfg,
    }


def registry(rank: int, world: int) -> dict:
    """Lookups for every backend x device (verl's own device override), and double registration."""
    import importlib
    import os

    plugin = _plugin()
    from verl.workers.engine.base import EngineRegistry

    found = {}
    for model_type in (plugin.MODEL_TYPE, plugin.SHARED_MODEL_TYPE):
        for backend in plugin.BACKENDS:
            for device in plugin.DEVICES:
                os.environ["VERL_ENGINE_DEVICE"] = device
                cls = EngineRegistry.get_engine_cls(model_type, backend)
                found[f"{model_type}/{backend}/{device}"] = f"{cls.__module__}.{cls.__qualname__}"
    os.environ.pop("VERL_ENGINE_DEVICE")
    again = plugin.register()
    reloaded = importlib.reload(plugin).REGISTERED  # a re-import makes a new class object: still harmless
    try:
        EngineRegistry.register(model_type=plugin.MODEL_TYPE, backend="fsdp2", device="cpu")(
            plugin.SPDiffusersEngine
        )
        raw_duplicate = None
    except AssertionError as err:  # why register() must be idempotent
        raw_duplicate = str(err)
    from verl.utils.device import get_device_name, get_nccl_backend

    return {
        "multi_output": multi_output(),
        "found": found,
        "again": again,
        "reloaded": reloaded,
        "raw_duplicate": raw_duplicate,
        "device": get_device_name(),
        "backend": get_nccl_backend(),
        "dist_backend": dist.get_backend(),
        "config_errors": config_errors(rank, world),
    }


def config_errors(rank: int, world: int) -> dict:
    """Settings the engine refuses, each with the message it gives."""
    plugin = _plugin()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    cases = {
        "sp3": (
            FSDPEngineConfig(ulysses_sequence_parallel_size=3, strategy="fsdp2"),
            FSDPOptimizerConfig(lr=1e-4),
        ),
        "cosine": (
            FSDPEngineConfig(strategy="fsdp2"),
            FSDPOptimizerConfig(lr=1e-4, lr_scheduler_type="cosine"),
        ),
        "fsdp_size": (FSDPEngineConfig(strategy="fsdp2", fsdp_size=2), FSDPOptimizerConfig(lr=1e-4)),
        "ring3": (FSDPEngineConfig(strategy="fsdp2"), FSDPOptimizerConfig(lr=1e-4)),
    }
    out = {}
    for name, (engine_config, optimizer_config) in cases.items():
        try:
            EngineRegistry.new(
                model_type=plugin.MODEL_TYPE,
                backend=engine_config.strategy,
                model_config=plugin.DiffusionModelConfig(
                    tiny="qwenimage", ring_degree=3 if name == "ring3" else 1
                ),
                engine_config=engine_config,
                optimizer_config=optimizer_config,
                checkpoint_config=CheckpointConfig(),
            )
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def trainer_identity(rank: int, world: int) -> dict:
    """The FlowGRPO trainer with the engine built through verl's registry vs built directly: same numbers."""
    _plugin()
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer
    from sp_diffusers.integrations.verl import fsdp_engine_via_verl
    from tests.workers.engine_steps import _config, _full

    runs = {}
    for name, factory in (("native", None), ("verl", fsdp_engine_via_verl)):
        config = _config(world, lora=True)
        config.train.iterations, config.train.save_every = 2, 0
        torch.manual_seed(1234)
        trainer = FlowGRPOTrainer(config, engine_factory=factory)
        history = trainer.run()
        runs[name] = {
            "history": [  # times differ run to run; everything else must not
                {k: v for k, v in m.items() if k not in ("seconds", "text_encode_seconds") and "_seconds/" not in k}
                for m in history
            ],
            "params": {n: _full(p) for n, p in trainer.engine.model.named_parameters() if p.requires_grad},
            "has_verl_engine": hasattr(trainer.engine, "verl_engine"),
        }
    return runs


def multi_output() -> dict:
    """LTX-2 (a transformer with two outputs, video and audio) through verl's surface: verl's keyword loss form
    (one ``model_pred`` tensor) is refused with the fix; an ``engine_loss`` reads both outputs and trains."""
    plugin = _plugin()
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    from sp_diffusers.integrations.verl import engine_loss
    from sp_diffusers.tiny.specs import tiny_inputs

    engine_config = FSDPEngineConfig(strategy="fsdp2")
    engine = EngineRegistry.new(
        model_type=plugin.MODEL_TYPE,
        backend=engine_config.strategy,
        model_config=plugin.DiffusionModelConfig(tiny="ltx2"),
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-4),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    model = engine._engine().model
    inputs = tiny_inputs("ltx2", model, batch=2, text_len=8, image_hw=(4, 4), ragged_text=False)
    tensors = {("latents" if k == "hidden_states" else k): v for k, v in inputs.items() if torch.is_tensor(v)}
    extras = {k: v for k, v in inputs.items() if not torch.is_tensor(v)}

    def data():
        return tu.get_tensordict(dict(tensors), dict(extras))

    try:
        engine.forward_backward_batch(data(), lambda model_output, data, dp_group=None: None, forward_only=True)
        refused = None
    except ValueError as err:
        refused = str(err)

    @engine_loss
    def both_streams(eng, batch):
        video, audio = eng.forward(**{k: batch["latents" if k == "hidden_states" else k] for k in inputs})
        loss = video.float().pow(2).mean() + audio.float().pow(2).mean()
        return loss, {"video_numel": video.numel(), "audio_numel": audio.numel()}

    out = engine.forward_backward_batch(data(), both_streams)
    return {"refused": refused, "loss": out["loss"], "metrics": out["metrics"]}
