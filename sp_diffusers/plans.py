"""Context-parallel plans for models diffusers ships without one (SD3 / SD3.5, ...), in diffusers' own
declarative form, plus the processor each needs to route attention through the dispatcher.

A plan is diffusers' ``_cp_plan`` dict (which module inputs/outputs to split or gather along which dim)
and, where the model's attention processor calls SDPA directly (so no backend or parallel config can
reach it), a ``prepare(model)`` that swaps in a processor that computes the same function through
``dispatch_attention_fn``. ``sp_diffusers.install()`` attaches a plan only to classes whose installed
diffusers has none, and runs ``prepare`` before ``set_attention_backend`` / ``enable_parallelism``.
Users register plans for their own models with :func:`register_plan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .patches._base import AttributeSwaps

logger = logging.getLogger(__name__)

__all__ = [
    "ModelPlan",
    "PlanStatus",
    "SD3JointAttnProcessor",
    "attach",
    "detach",
    "register_plan",
    "registered_plans",
]


@dataclass(frozen=True)
class ModelPlan:
    model_class: str  # the diffusers class name, e.g. "SD3Transformer2DModel"
    cp_plan: Callable[[], dict]  # built lazily: ContextParallelInput/Output live in diffusers
    prepare: Callable[[torch.nn.Module], None] | None = None
    module: str = "diffusers"  # where the class is importable from


@dataclass(frozen=True)
class PlanStatus:
    model_class: str
    attached: bool
    reason: str


_PLANS: dict[str, ModelPlan] = {}
_swaps = AttributeSwaps()
_attached: list[type] = []


def register_plan(
    model_class: str | type,
    cp_plan: dict | Callable[[], dict],
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> None:
    """Register a context-parallel plan for ``model_class`` (a class or its name in ``diffusers``).

    Takes effect at the next ``sp_diffusers.install()`` (call ``uninstall()`` first if already installed).
    """
    name = model_class if isinstance(model_class, str) else model_class.__name__
    module = "diffusers" if isinstance(model_class, str) else model_class.__module__
    builder = cp_plan if callable(cp_plan) else (lambda plan=cp_plan: plan)
    _PLANS[name] = ModelPlan(name, builder, prepare, module)


def registered_plans() -> dict[str, ModelPlan]:
    return dict(_PLANS)


def _resolve(plan: ModelPlan) -> type | None:
    import importlib

    module = importlib.import_module(plan.module)
    return getattr(module, plan.model_class, None)


def prepare_model(model: torch.nn.Module) -> None:
    """Run the ``prepare`` of ``model``'s plan (idempotent); a no-op for other models."""
    for cls in type(model).__mro__:
        plan = _PLANS.get(cls.__name__)
        if plan is not None and plan.prepare is not None and cls in _attached:
            plan.prepare(model)
            return


def attach() -> list[PlanStatus]:
    """Attach every registered plan whose class has no ``_cp_plan`` in the installed diffusers."""
    from diffusers.models.modeling_utils import ModelMixin

    statuses = []
    for plan in _PLANS.values():
        cls = _resolve(plan)
        if cls is None:
            statuses.append(PlanStatus(plan.model_class, False, "class not in this diffusers version"))
            continue
        if getattr(cls, "_cp_plan", None) is not None:
            statuses.append(PlanStatus(plan.model_class, False, "diffusers ships its own _cp_plan"))
            continue
        _swaps.set(cls, "_cp_plan", plan.cp_plan())
        _attached.append(cls)
        statuses.append(
            PlanStatus(plan.model_class, True, "diffusers has no _cp_plan: sp_diffusers plan attached")
        )
    if _attached:
        # a processor swapped in after set_attention_backend would miss the backend: prepare first
        for name in ("set_attention_backend", "enable_parallelism"):
            _swaps.set(ModelMixin, name, _preparing(getattr(ModelMixin, name)))
    return statuses


def _preparing(original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        prepare_model(self)
        return original(self, *args, **kwargs)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__doc__ = original.__doc__
    method.__name__ = original.__name__
    return method


def detach() -> None:
    _swaps.restore()
    _attached.clear()


# ------------------------------------------------------------------------------------------------ SD3


class SD3JointAttnProcessor:
    """``JointAttnProcessor2_0`` (SD3 / SD3.5 MMDiT, incl. qk-norm and dual attention) through the dispatcher.

    Same function as diffusers' processor, but attention goes through ``dispatch_attention_fn`` with this
    processor's backend and parallel config, so ``ulysses_sdpa`` (or any backend) and context parallelism
    apply. Under a plan the image tokens ``[B, N/P, D]`` and the text tokens ``[B, T/P, D]`` are both
    sequence-sharded; each rank attends over ``cat([image_r, text_r])`` and the all-to-all gathers the keys
    as ``[image_0, text_0, image_1, text_1, ...]``.

    ``encoder_hidden_states_mask`` (``[B, T]`` bool over the global text length, passed through
    ``joint_attention_kwargs``) masks padded text keys, so text padded to a multiple of the SP degree gives
    exactly the unpadded result; the joint key mask is built in the all-to-all's key order.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attention_mask is not None:
            raise ValueError(
                "SD3JointAttnProcessor takes no attention_mask; pass encoder_hidden_states_mask [B, T] (text keys) "
                "through joint_attention_kwargs instead"
            )
        image_tokens = hidden_states.shape[1]
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, N, H, D]
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = None
        if encoder_hidden_states is not None:
            text_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
            if encoder_hidden_states_mask is not None:
                mask = self._joint_key_mask(
                    encoder_hidden_states_mask, image_tokens, encoder_hidden_states.shape[1]
                )
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image_out, text_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out

    def _joint_key_mask(self, text_mask: torch.Tensor, image_local: int, text_local: int) -> torch.Tensor:
        """``[B, T]`` text mask -> the ``[B, keys]`` mask of the joint keys, in the order attention sees them."""
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        world = cp.ulysses_degree * cp.ring_degree if cp is not None else 1
        batch = text_mask.shape[0]
        if text_mask.dim() != 2 or text_mask.shape[1] != world * text_local:
            raise ValueError(
                f"encoder_hidden_states_mask must be [B, T] over the global text length {world * text_local}, got "
                f"shape {tuple(text_mask.shape)}; fix: pass the mask of the (padded) encoder_hidden_states"
            )
        text = text_mask.to(torch.bool).unflatten(1, (world, text_local))
        image = torch.ones((batch, world, image_local), dtype=torch.bool, device=text_mask.device)
        return torch.cat([image, text], dim=2).flatten(1)


def _sd3_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        # the patch embedding adds absolute positions before the split, so each shard keeps its own
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "context_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_sd3(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is JointAttnProcessor2_0:
            module.set_processor(SD3JointAttnProcessor())


register_plan("SD3Transformer2DModel", _sd3_plan, _prepare_sd3)
