"""No way to share a data x sequence-parallel mesh with diffusers 0.36/0.37.

Defect: ``ContextParallelConfig`` only takes ``mesh=`` from 0.38; before, ``enable_parallelism`` always
builds its own ``("ring", "ulysses")`` mesh over the *whole* world (``init_device_mesh`` fails when
ring * ulysses < world) and ``ContextParallelConfig.setup`` flattens every dim of the mesh it gets. So
DP x SP (FSDP over a shared mesh) is impossible.
Affected: diffusers 0.36.x and 0.37.x. Upstream: fixed by the ``mesh=`` field in 0.38.0.
Fix: ``sp_diffusers.context_parallel_config(..., mesh=mesh)`` stores the mesh on the config; inside
``enable_parallelism`` diffusers' own mesh construction returns that mesh's ``("ring", "ulysses")``
sub-mesh, which is then what ``setup`` flattens.
"""

from __future__ import annotations

import contextlib

import torch.distributed.device_mesh as device_mesh_module

from ._base import AttributeSwaps, Probe, logger

# The attribute that carries a shared mesh on a ContextParallelConfig that has no `mesh` field; set by
# sp_diffusers.context_parallel_config, read here inside enable_parallelism.
INJECTED_MESH_ATTR = "_sp_diffusers_mesh"

NAME = "mesh_injection"
AFFECTED = "0.36-0.37"
UPSTREAM = "fixed upstream by ContextParallelConfig(mesh=...) in 0.38.0"

_swaps = AttributeSwaps()


def probe() -> Probe:
    from sp_diffusers.compat import config_accepts_mesh

    if config_accepts_mesh():
        return Probe(False, "ContextParallelConfig accepts mesh=")
    return Probe(True, "ContextParallelConfig has no mesh field; enable_parallelism builds a world-wide mesh")


@contextlib.contextmanager
def _init_device_mesh_returns(sub_mesh):
    original = device_mesh_module.init_device_mesh
    device_mesh_module.init_device_mesh = lambda *args, **kwargs: sub_mesh
    try:
        yield
    finally:
        device_mesh_module.init_device_mesh = original


def apply() -> None:
    if _swaps.active:
        return
    from diffusers import ContextParallelConfig
    from diffusers.models.modeling_utils import ModelMixin

    original = ModelMixin.enable_parallelism

    def enable_parallelism(self, *, config, cp_plan=None):
        cp = (
            config
            if isinstance(config, ContextParallelConfig)
            else getattr(config, "context_parallel_config", None)
        )
        mesh = getattr(cp, INJECTED_MESH_ATTR, None)
        if mesh is None:
            return original(self, config=config, cp_plan=cp_plan)
        with _init_device_mesh_returns(mesh["ring", "ulysses"]):
            return original(self, config=config, cp_plan=cp_plan)

    enable_parallelism.__wrapped__ = original  # type: ignore[attr-defined]
    enable_parallelism.__doc__ = original.__doc__
    _swaps.set(ModelMixin, "enable_parallelism", enable_parallelism)
    logger.info("patched ModelMixin.enable_parallelism: a shared (dp, ring, ulysses) mesh is honoured")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
