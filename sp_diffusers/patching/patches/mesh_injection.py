"""No way to share a data x sequence-parallel mesh with diffusers 0.36/0.37.

Defect: ``ContextParallelConfig`` only takes ``mesh=`` from 0.38; before, ``enable_parallelism`` always
builds its own ``("ring", "ulysses")`` mesh over the *whole* world (``init_device_mesh`` fails when
ring * ulysses < world) and ``ContextParallelConfig.setup`` flattens every dim of the mesh it gets. So
DP x SP (FSDP over a shared mesh) is impossible.
Affected: diffusers 0.36.x and 0.37.x. Upstream: fixed by the ``mesh=`` field in 0.38.0.
Fix: ``ContextParallelConfig(..., mesh=mesh)`` is accepted as on 0.38 (the constructor stores the mesh
on the config; so does ``sp_diffusers.context_parallel_config(..., mesh=mesh)``), so code written for
0.38+ (verl-omni's engine, for one) runs unchanged; inside ``enable_parallelism`` diffusers' own mesh
construction returns that mesh's ``("ring", "ulysses")`` sub-mesh, which is then what ``setup`` flattens.
``setup`` also slices ``"ring"`` and ``"ulysses"`` out of that sub-mesh, which torch 2.7's DeviceMesh refuses
("Cannot create a submesh from a submesh", pytorch#143194; later releases allow it): those two come from the
shared mesh itself, the same process groups.
"""

from __future__ import annotations

import contextlib

import torch.distributed.device_mesh as device_mesh_module

from ..swaps import AttributeSwaps
from ._base import Probe, logger

# The attribute that carries a shared mesh on a ContextParallelConfig that has no `mesh` field; set by
# sp_diffusers.context_parallel_config, read here inside enable_parallelism.
INJECTED_MESH_ATTR = "_sp_diffusers_mesh"

NAME = "mesh_injection"
AFFECTED = "0.36-0.37"
UPSTREAM = "fixed upstream by ContextParallelConfig(mesh=...) in 0.38.0"

_swaps = AttributeSwaps()


def probe() -> Probe:
    from ..compat import config_accepts_mesh

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


class _SlicedFromRoot:
    """The ``(ring, ulysses)`` sub-mesh as diffusers' ``setup`` uses it: flattened as itself, its single dims
    sliced from the shared mesh (every torch slices a root mesh; torch 2.7 refuses to slice a sub-mesh)."""

    def __init__(self, sub_mesh, root_mesh) -> None:
        self._sub, self._root = sub_mesh, root_mesh

    def _flatten(self, *args, **kwargs):
        return self._sub._flatten(*args, **kwargs)

    def __getitem__(self, name):
        return self._root[name]


def _setup_slices_from_root(config_cls) -> None:
    original = vars(config_cls)["setup"]

    def setup(self, rank, world_size, device, mesh):
        root = getattr(self, INJECTED_MESH_ATTR, None)
        if root is None:
            return original(self, rank, world_size, device, mesh)
        original(self, rank, world_size, device, _SlicedFromRoot(mesh, root))
        self._mesh = mesh  # what diffusers keeps: the (ring, ulysses) sub-mesh
        return None

    setup.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(config_cls, "setup", setup)


def check_mesh(mesh, ulysses_degree: int, ring_degree: int) -> None:
    """The mesh must have ``ring`` and ``ulysses`` dims of the config's degrees (what 0.38+ requires)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    missing = [n for n in ("ring", "ulysses") if n not in names]
    if missing:
        raise ValueError(
            f"ContextParallelConfig(mesh=...): the mesh has dims {names or '(unnamed)'} but needs 'ring' and "
            f"'ulysses' (missing: {missing}); fix: build it with mesh_dim_names including both, e.g. "
            "init_device_mesh(device, (dp, ring, ulysses), mesh_dim_names=('dp', 'ring', 'ulysses'))"
        )
    sizes = dict(zip(names, mesh.shape, strict=True))
    for name, degree in (("ulysses", ulysses_degree), ("ring", ring_degree)):
        if sizes[name] != degree:
            raise ValueError(
                f"ContextParallelConfig(mesh=...): mesh dim '{name}' has size {sizes[name]} but "
                f"{name}_degree={degree}; fix: give the mesh and the config the same degrees"
            )


def _accept_mesh_in_constructor(config_cls) -> None:
    # The dataclass has no `mesh` field here: take the keyword, let diffusers validate the rest, and carry the
    # mesh on the attribute enable_parallelism reads below.
    original = vars(config_cls)["__init__"]

    def __init__(self, *args, mesh=None, **kwargs):
        original(self, *args, **kwargs)
        if mesh is not None:
            check_mesh(mesh, self.ulysses_degree, self.ring_degree)
            setattr(self, INJECTED_MESH_ATTR, mesh)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(config_cls, "__init__", __init__)


def apply() -> None:
    if _swaps.active:
        return
    from diffusers import ContextParallelConfig
    from diffusers.models.modeling_utils import ModelMixin

    _accept_mesh_in_constructor(ContextParallelConfig)
    _setup_slices_from_root(ContextParallelConfig)

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
    logger.info(
        "patched ContextParallelConfig(mesh=...) and ModelMixin.enable_parallelism: a shared "
        "(dp, ring, ulysses) mesh is honoured"
    )


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
