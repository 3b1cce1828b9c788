"""A stand-in for verl-omni (``verl-project/verl-omni``, which is not on PyPI), written for these tests.

``write(root)`` creates a package ``verl_omni`` under ``root`` with verl-omni's module paths and, written from
the description of its code (docs/integrations.md, "verl-omni"), what sp-diffusers' ``verl_omni_*`` patches
act on: the attn_backend whitelist in ``DiffusionModelConfig.__post_init__``, engines registered for
cuda/npu only, the diffusers >= 0.38 refusal in ``_init_device_mesh``, and the Qwen-Image mask fix gated
``< 0.38`` only. The engine follows the call sequence of verl-omni's ``PPODiffusersFSDPEngine``: verl's FSDP
mesh over the world plus a ``(dp, 1, sp)`` mesh named ``("dp", "ring", "ulysses")``; ``AutoModel.from_pretrained``
under verl's meta-init context; ``set_attention_backend(attn_backend)``; the pipeline class lookup (which
applies the mask fix); ``enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=mesh))``;
FSDP2 through verl's ``apply_fsdp2`` and ``fsdp2_load_full_state_dict``; text right-padded to a multiple of
sp; the loss divided by the accumulation steps and multiplied by sp. Nothing of verl-omni's code is in it.
Differences, on purpose: one micro-batch loop with one timestep (no sampler), dense text in and cut to the
micro-batch's longest prompt (verl-omni densifies jagged prompts per micro-batch), and ``txt_seq_lens`` on
diffusers 0.36 (that Qwen-Image needs it; verl-omni's adapter does not pass it).
"""

from __future__ import annotations

from pathlib import Path

_INIT = '''"""Stand-in for verl-omni (sp-diffusers tests), imported in verl-omni's order: models (no verl), then
pipelines (the first import of verl when nothing imported it before), then the engines."""
import verl_omni.models  # noqa: F401
import verl_omni.pipelines  # noqa: F401
import verl_omni.workers.engine  # noqa: F401
'''

_QWEN_IMAGE = '''import diffusers
import torch
from packaging import version


def apply_qwen_image_ulysses_mask_fix():
    """Rebuild the joint mask in all-to-all order under Ulysses; gated below 0.38 only (the defect)."""
    if version.parse(diffusers.__version__) < version.parse("0.38.0"):
        return
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    inner = QwenImageTransformer2DModel.forward
    if getattr(inner, "_verl_omni_ulysses_mask_patched", False):
        return

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                attention_kwargs=None, **kwargs):
        parallel = getattr(self, "_parallel_config", None)
        cp = parallel.context_parallel_config if parallel is not None else None
        degree = cp.ulysses_degree if cp is not None else 1
        if degree > 1 and encoder_hidden_states_mask is not None:
            image = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            pairs = zip(encoder_hidden_states_mask.bool().chunk(degree, dim=1), image.chunk(degree, dim=1))
            joint = torch.cat([part for pair in pairs for part in pair], dim=1)
            attention_kwargs = dict(attention_kwargs or {}, attention_mask=joint[:, None, None, :])
            encoder_hidden_states_mask = None
        return inner(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                     encoder_hidden_states_mask=encoder_hidden_states_mask, attention_kwargs=attention_kwargs,
                     **kwargs)

    forward._verl_omni_ulysses_mask_patched = True
    QwenImageTransformer2DModel.forward = forward
'''

_MODEL_BASE = """from verl.utils import tensordict_utils as tu  # noqa: F401  (verl-omni's pipelines import verl)


class DiffusionModelBase:
    @classmethod
    def get_class(cls, model_config):
        if model_config.architecture in {"QwenImagePipeline", "QwenImageEditPlusPipeline"}:
            from verl_omni.models.diffusers.qwen_image import apply_qwen_image_ulysses_mask_fix

            apply_qwen_image_ulysses_mask_fix()
        return cls
"""

_CONFIG = """from dataclasses import dataclass
from typing import Optional

from verl.base_config import BaseConfig


@dataclass
class DiffusionModelConfig(BaseConfig):
    path: str = ""
    architecture: Optional[str] = "QwenImagePipeline"
    external_lib: Optional[str] = None
    enable_gradient_checkpointing: bool = True
    attn_backend: str = "_flash_3_varlen_hub"
    lora_rank: int = 0

    def __post_init__(self):
        valid_backends = {"native", "_native_npu", "_flash_3_varlen_hub"}
        if self.attn_backend not in valid_backends:
            raise ValueError(f"Invalid attn_backend: {self.attn_backend}. Must be one of {sorted(valid_backends)}")
"""

_LOSSES = '''from verl.utils import tensordict_utils as tu


def mse_loss(config, model_output, data, dp_group=None):
    """The velocity MSE, scaled as verl-omni scales every diffusion loss."""
    loss = (model_output["model_pred"] - data["target"]).pow(2).mean()
    loss = loss / tu.get_non_tensor_data(data, "gradient_accumulation_steps", default=None)
    sp_size = tu.get_non_tensor_data(data, "sp_size", default=None)
    if sp_size > 1:  # FSDP averages over dp x sp ranks; the SP ranks share one sample
        loss = loss * sp_size
    return loss, {"loss": loss.detach()}
'''

_ENGINE = """import inspect

import diffusers
import torch
import torch.distributed as dist
from packaging import version
from torch.distributed.device_mesh import init_device_mesh
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name
from verl.utils.fsdp_utils import (
    MixedPrecisionPolicy, apply_fsdp2, fsdp2_load_full_state_dict, get_init_weight_context_manager,
)
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp.utils import create_device_mesh

from verl_omni.pipelines.model_base import DiffusionModelBase

device_name = get_device_name()


class DiffusersFSDPEngine(BaseEngine):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self._init_device_mesh()

    def _init_device_mesh(self):
        world = dist.get_world_size()
        self.device_mesh = create_device_mesh(world_size=world, fsdp_size=self.engine_config.fsdp_size)
        self.ulysses_device_mesh = None
        self.ulysses_sequence_parallel_size = sp = self.engine_config.ulysses_sequence_parallel_size
        if sp > 1:
            if version.parse(diffusers.__version__) < version.parse("0.38.0"):
                raise RuntimeError(
                    f"Ulysses sequence parallelism requires diffusers >= 0.38.0 (found {diffusers.__version__}). "
                )
            self.ulysses_device_mesh = init_device_mesh(
                device_name, mesh_shape=(world // sp, 1, sp), mesh_dim_names=["dp", "ring", "ulysses"]
            )
        self.use_ulysses_sp = sp > 1

    def get_data_parallel_rank(self):
        if self.ulysses_device_mesh is not None:
            return self.ulysses_device_mesh["dp"].get_local_rank()
        return dist.get_rank()

    def get_data_parallel_size(self):
        return dist.get_world_size() // self.ulysses_sequence_parallel_size

    def initialize(self):
        from diffusers import AutoModel, ContextParallelConfig

        with get_init_weight_context_manager(use_meta_tensor=True, mesh=self.device_mesh)():
            module = AutoModel.from_pretrained(self.model_config.path, subfolder="transformer",
                                               torch_dtype=torch.float32)
            module.set_attention_backend(self.model_config.attn_backend)
            if self.model_config.enable_gradient_checkpointing:
                module.enable_gradient_checkpointing()
        DiffusionModelBase.get_class(self.model_config)  # configure_trainable_params' lookup
        if self.use_ulysses_sp:
            module.enable_parallelism(
                config=ContextParallelConfig(ulysses_degree=self.ulysses_sequence_parallel_size,
                                             mesh=self.ulysses_device_mesh)
            )
        mp = self.engine_config.mixed_precision or {}
        policy = MixedPrecisionPolicy(param_dtype=PrecisionType.to_dtype(mp.get("param_dtype", "bf16")),
                                      reduce_dtype=PrecisionType.to_dtype(mp.get("reduce_dtype", "fp32")),
                                      cast_forward_inputs=True)
        fsdp_kwargs = {"mesh": self.device_mesh, "mp_policy": policy, "offload_policy": None,
                       "reshard_after_forward": self.engine_config.reshard_after_forward}
        full_state = module.state_dict()
        apply_fsdp2(module, fsdp_kwargs, self.engine_config)
        fsdp2_load_full_state_dict(module, full_state, self.device_mesh, None)
        self.module = module

    def _pad_embeds_for_sp(self, embeds, mask):
        sp = self.ulysses_sequence_parallel_size
        pad = -embeds.size(1) % sp
        if pad:
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
            mask = torch.nn.functional.pad(mask, (0, pad))
        return embeds, mask

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        micro = tu.get_non_tensor_data(data, "micro_batch_size_per_gpu", default=None)
        n = data["latents"].shape[0]
        starts = range(0, n, micro)
        losses = []
        for start in starts:
            rows = slice(start, start + micro)
            mask = data["prompt_embeds_mask"][rows]
            length = int(mask.sum(1).max())  # verl-omni densifies each micro-batch's jagged prompts
            embeds, mask = self._pad_embeds_for_sp(data["prompt_embeds"][rows, :length], mask[:, :length])
            batch = mask.shape[0]
            inputs = dict(hidden_states=data["latents"][rows], timestep=data["timestep"][rows],
                          encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                          img_shapes=[data["img_shape"]] * batch, return_dict=False)
            if "txt_seq_lens" in inspect.signature(type(self.module).forward).parameters and (
                version.parse(diffusers.__version__) < version.parse("0.37.0")
            ):
                inputs["txt_seq_lens"] = [embeds.shape[1]] * batch
            pred = self.module(**inputs)[0]
            mb = tu.get_tensordict({"target": data["target"][rows]},
                                   {"sp_size": self.ulysses_sequence_parallel_size,
                                    "gradient_accumulation_steps": len(starts)})
            loss, _ = loss_function(model_output={"model_pred": pred}, data=mb)
            if not forward_only:
                loss.backward()
            losses.append(float(loss.detach()))
        return {"loss": losses}


@EngineRegistry.register(model_type="diffusion_model", backend=["fsdp", "fsdp2"], device=["cuda", "npu"])
class PPODiffusersFSDPEngine(DiffusersFSDPEngine):
    pass


@EngineRegistry.register(model_type="diffusion_dpo_model", backend=["fsdp", "fsdp2"], device=["cuda", "npu"])
class DPODiffusersFSDPEngine(DiffusersFSDPEngine):
    pass
"""

FILES = {
    "__init__.py": _INIT,
    "models/__init__.py": "from .diffusers import apply_qwen_image_ulysses_mask_fix  # noqa: F401\n",
    "models/diffusers/__init__.py": "from .qwen_image import apply_qwen_image_ulysses_mask_fix  # noqa: F401\n",
    "models/diffusers/qwen_image.py": _QWEN_IMAGE,
    "pipelines/__init__.py": "from . import model_base  # noqa: F401\n",
    "pipelines/model_base.py": _MODEL_BASE,
    "workers/__init__.py": "",
    "workers/config/__init__.py": "",
    "workers/config/diffusion/__init__.py": "",
    "workers/config/diffusion/model.py": _CONFIG,
    "workers/utils/__init__.py": "",
    "workers/utils/losses.py": _LOSSES,
    "workers/engine/__init__.py": "import verl_omni.workers.engine.fsdp.diffusers_impl  # noqa: F401\n",
    "workers/engine/fsdp/__init__.py": "",
    "workers/engine/fsdp/diffusers_impl.py": _ENGINE,
}


# verl-omni after its PR #497 (floors diffusers >= 0.40, transformers >= 5.13): the Qwen-Image mask patch is
# deleted (diffusers#13756 fixed the defect in 0.39), ``verl_omni.models`` is a docstring, and the pipeline
# lookup applies nothing. The rest is left as above (not verified against that source).
AFTER_PR_497 = {
    **{k: v for k, v in FILES.items() if not k.startswith("models/diffusers/")},
    "models/__init__.py": '"""Model packages (the diffusers patches were dropped at the diffusers>=0.40 floor)."""\n',
    "pipelines/model_base.py": _MODEL_BASE.replace(
        """        if model_config.architecture in {"QwenImagePipeline", "QwenImageEditPlusPipeline"}:
            from verl_omni.models.diffusers.qwen_image import apply_qwen_image_ulysses_mask_fix

            apply_qwen_image_ulysses_mask_fix()
""",
        "",
    ),
}


def write(root: str | Path, files: dict[str, str] = FILES) -> Path:
    """Write the stand-in package (``FILES``: verl-omni a1139ba; ``AFTER_PR_497``) as ``root/verl_omni``;
    returns ``root`` (the folder for sys.path)."""
    root = Path(root)
    for relative, text in files.items():
        path = root / "verl_omni" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
