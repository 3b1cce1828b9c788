"""The plan registry: which model classes get which context-parallel plan, attached and detached by
``install()`` / ``uninstall()``, and the ``prepare`` hook that swaps in dispatcher-routed processors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..swaps import AttributeSwaps

logger = logging.getLogger(__name__)

__all__ = [
    "ModelPlan",
    "PlanStatus",
    "attach",
    "detach",
    "prepare_model",
    "register_plan",
    "registered_plans",
    "swap_processors",
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


def swap_processors(model: torch.nn.Module, old: type, make: Callable[[], Any]) -> None:
    """Give every ``Attention`` of ``model`` whose processor is exactly ``old`` a fresh ``make()`` (a plan's
    prepare hook: the processor that routes attention through the dispatcher with the plan's masks)."""
    from diffusers.models.attention_processor import Attention

    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is old:
            module.set_processor(make())


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
