"""verl-omni's call sequence on real gloo ranks: the stand-in engine of ``verl_omni_fake`` built through verl's
``EngineRegistry.new`` from verl's hydra configs, with sp-diffusers loaded by ``import verl`` (the
``verl.plugins`` entry point) and nothing else of ours called. Each function returns plain data; the parent
asserts. Run with ``VERL_PLATFORM=cpu`` and plugin discovery on.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

G, MICRO = 8, 2  # global samples, micro-batch rows (dp 2: two micro-batches per rank)
TOKENS, LATENT_DIM, TEXT_DIM, OUT_DIM = 16, 16, 32, 16  # the tiny Qwen-Image: 4 x 4 patches, 4 heads
# 0.37+: micro-batch maxima 7, 9, 6, 9: verl-omni pads them to a multiple of sp (masked keys).
# 0.36's Qwen-Image ignores the text mask with or without SP, so a padded key would change its function:
# there every micro-batch's longest prompt is already a multiple of 4.
TEXT_LENGTHS = (5, 7, 3, 9, 6, 4, 9, 5)
TEXT_LENGTHS_036 = (5, 8, 3, 4, 8, 4, 8, 5)
BACKENDS = ("ulysses_sdpa", "native")
LAYOUTS = {"dp1": 4, "dp2": 2}  # on 4 ranks: the SP degree of each layout (dp = 4 / sp)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger().setLevel(logging.ERROR)
    os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")


def _backend_registered() -> bool:
    from diffusers.models.attention_dispatch import AttentionBackendName

    return "ulysses_sdpa" in {m.value for m in AttentionBackendName}


def _model_dir(root: str) -> str:
    """A pipeline folder with the tiny Qwen-Image transformer, written once by rank 0 of each run."""
    path = Path(root) / "tiny-qwen-image"
    if dist.get_rank() == 0 and not (path / "transformer").is_dir():
        from sp_diffusers.tiny import tiny_model

        torch.manual_seed(0)
        tiny_model("qwenimage", num_layers=2).save_pretrained(path / "transformer")
    dist.barrier()
    return str(path)


def _configs(model_dir: str, backend: str, sp: int):
    """verl's own engine and optimizer yaml (hydra), and verl-omni's model config by its ``_target_``."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    root = Path(verl.__file__).parent / "trainer" / "config"
    overrides = {
        "engine": [
            "strategy=fsdp2",
            f"ulysses_sequence_parallel_size={sp}",
            "+mixed_precision.param_dtype=fp32",  # compared at fp32 (verl-omni's default is bf16)
            "+mixed_precision.reduce_dtype=fp32",
        ],
        "optim": ["lr=1e-3", "clip_grad=1e9"],
    }
    built = {}
    for group, extra in overrides.items():
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(root / group), version_base=None):
            built[group] = omega_conf_to_dataclass(compose(config_name="fsdp", overrides=extra))
    GlobalHydra.instance().clear()
    model = OmegaConf.create(
        {
            "_target_": "verl_omni.workers.config.diffusion.model.DiffusionModelConfig",
            "path": model_dir,
            "architecture": "QwenImagePipeline",
            "attn_backend": backend,  # = actor_rollout_ref.model.attn_backend
        }
    )
    return omega_conf_to_dataclass(model), built["engine"], built["optim"]


def _engine(model_dir: str, backend: str, sp: int):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.engine.base import EngineRegistry

    model_config, engine_config, optim_config = _configs(model_dir, backend, sp)
    engine = EngineRegistry.new(
        model_type="diffusion_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optim_config,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def _data() -> dict:
    import diffusers
    from packaging.version import Version

    old = Version(diffusers.__version__) < Version("0.37")
    lengths = TEXT_LENGTHS_036 if old else TEXT_LENGTHS
    g = torch.Generator().manual_seed(7)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return {
        "latents": torch.randn(G, TOKENS, LATENT_DIM, generator=g),
        "prompt_embeds": torch.randn(G, max(lengths), TEXT_DIM, generator=g)
        * mask[..., None],  # 0 at padding
        "prompt_embeds_mask": mask,
        "timestep": torch.rand(G, generator=g),
        "target": torch.randn(G, TOKENS, OUT_DIM, generator=g),
    }


def _tensordict(data: dict, rows: slice):
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(
        {k: v[rows] for k, v in data.items()}, {"micro_batch_size_per_gpu": MICRO, "img_shape": [(1, 4, 4)]}
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _step(engine, data: dict) -> dict:
    """One forward/backward of this rank's dp slice; every parameter's full gradient (rank 0 keeps them)."""
    from verl_omni.workers.utils.losses import mse_loss

    dp, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
    n = G // dp
    out = engine.forward_backward_batch(
        _tensordict(data, slice(dp_rank * n, (dp_rank + 1) * n)), partial(mse_loss, None)
    )
    grads = {name: _full(p.grad) for name, p in engine.module.named_parameters() if p.grad is not None}
    cp = engine.module._parallel_config.context_parallel_config if engine.module._parallel_config else None
    return {
        "grads": grads if dist.get_rank() == 0 else {},
        "losses": out["loss"],
        "processor_backends": sorted(
            {
                str(getattr(b, "value", b))  # an AttentionBackendName member
                for b in (
                    getattr(p, "_attention_backend", None) for p in engine.module.attn_processors.values()
                )
            }
        ),
        "ulysses_degree": cp.ulysses_degree if cp is not None else 1,
        "dp": dp,
    }


def _reference(model_dir: str, data: dict) -> dict:
    """The same forward/backward in this one process: verl-omni's engine code at sp 1, no FSDP, no mesh."""
    from diffusers import AutoModel
    from verl_omni.workers.engine.fsdp.diffusers_impl import PPODiffusersFSDPEngine
    from verl_omni.workers.utils.losses import mse_loss

    module = AutoModel.from_pretrained(model_dir, subfolder="transformer", torch_dtype=torch.float32)
    module.set_attention_backend("native")
    plain = object.__new__(PPODiffusersFSDPEngine)
    plain.module, plain.ulysses_sequence_parallel_size = module, 1
    out = plain.forward_backward_batch(_tensordict(data, slice(0, G)), partial(mse_loss, None))
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return {"grads": grads, "losses": out["loss"]}


def _expect_error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # what the defect raises (any type): returned for the parent to match
        return f"{type(err).__name__}: {err}"
    return None


def _controls(model_dir: str, sp: int, data: dict, ref_grads: dict) -> dict:
    """Each verl-omni patch this version needs: the defect without it, then the patch re-applied (now on a
    module already imported) fixes it."""
    from verl.workers.engine.base import EngineRegistry

    from sp_diffusers.patching.patches import (
        verl_omni_attn_backend,
        verl_omni_cpu_engine,
        verl_omni_min_diffusers,
        verl_omni_qwen_mask,
    )

    out: dict = {}

    def lookup():
        return EngineRegistry.get_engine_cls("diffusion_model", "fsdp2").__qualname__

    def config(backend):
        return lambda: _configs(model_dir, backend, sp)[0].attn_backend

    for patch, defect, fixed in (
        (verl_omni_attn_backend, config("ulysses_sdpa"), config("ulysses_sdpa")),
        (verl_omni_cpu_engine, lookup, lookup),
        (verl_omni_min_diffusers, lambda: _engine(model_dir, "ulysses_sdpa", sp), None),
    ):
        if not patch.is_applied():
            continue
        patch.revert()
        out[patch.NAME] = {"without": _expect_error(defect)}
        patch.apply()
        out[patch.NAME]["with"] = fixed() if fixed else None
    out["bogus_backend"] = _expect_error(config("not_a_backend"))  # the whitelist still refuses others
    from sp_diffusers.patching.patches import mesh_injection

    if mesh_injection.is_applied():  # 0.36/0.37: the constructor takes mesh= and checks it as 0.38+ needs
        from diffusers import ContextParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        flat = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        out["mesh_without_ring"] = _expect_error(lambda: ContextParallelConfig(ulysses_degree=2, mesh=flat))
    out["dpo_lookup"] = EngineRegistry.get_engine_cls("diffusion_dpo_model", "fsdp").__qualname__

    if verl_omni_qwen_mask.is_applied():
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

        verl_omni_qwen_mask.revert()
        result: dict = {}
        result["error"] = _expect_error(
            lambda: result.update(_step(_engine(model_dir, "ulysses_sdpa", sp), data))
        )
        forward = QwenImageTransformer2DModel.forward
        result["verl_omni_forward_on"] = bool(getattr(forward, verl_omni_qwen_mask.MARKER, False))
        if dist.get_rank() == 0 and result.get("grads"):
            result["max_grad_err"] = max(
                (result["grads"][n] - g).abs().max().item() for n, g in ref_grads.items()
            )
        result.pop("grads", None)
        verl_omni_qwen_mask.apply()  # the module is imported: verl-omni's forward comes off now
        forward = QwenImageTransformer2DModel.forward
        result["verl_omni_forward_after"] = bool(getattr(forward, verl_omni_qwen_mask.MARKER, False))
        out[verl_omni_qwen_mask.NAME] = result
    return out


def engine_parity(rank: int, world: int, root: str) -> dict:
    """Both layouts x both backends, and the patch controls (at dp 2), in one process group."""
    clock = [time.perf_counter()]
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        seconds[name] = round(clock[-1] - clock[-2], 2)

    _quiet()
    import verl  # noqa: F401  (the verl.plugins entry point installs sp-diffusers here)

    out: dict = {"backend_registered_by_import_verl": _backend_registered(), "seconds": seconds}
    import diffusers
    import verl_omni  # noqa: F401  (the stand-in: registers its engines)

    import sp_diffusers

    report = sp_diffusers.install()  # idempotent: the plugin's report
    out.update(diffusers=diffusers.__version__, applied=list(report.applied), report=str(report))
    lap("imports")
    model_dir = _model_dir(root)
    data = _data()
    ref = _reference(model_dir, data) if rank == 0 else {"grads": {}, "losses": []}
    dist.barrier()
    lap("reference")
    out["controls"] = _controls(model_dir, LAYOUTS["dp2"], data, ref["grads"])
    lap("controls")
    out["ref"] = ref
    for layout, sp in LAYOUTS.items():
        for backend in BACKENDS:
            out[f"{layout}/{backend}"] = _step(_engine(model_dir, backend, sp), data)
            dist.barrier()
            lap(f"{layout}/{backend}")
    return out
