"""``context_parallel_config()``: a diffusers ``ContextParallelConfig`` that works on every supported version.

diffusers >= 0.38 takes a shared mesh through ``ContextParallelConfig(mesh=...)``; 0.36/0.37 have no such
field, so the mesh rides on the config and the ``mesh_injection`` patch (applied by ``install()``) hands it
to diffusers inside ``enable_parallelism``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..parallel.mesh import MeshError, ParallelDims
from .compat import check_supported, config_accepts_mesh, config_accepts_ulysses_and_ring, diffusers_version
from .installer import is_installed
from .patches import mesh_injection

__all__ = ["context_parallel_config"]


def _check_mesh(mesh: Any, ulysses_degree: int, ring_degree: int) -> None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    missing = [n for n in ("ring", "ulysses") if n not in names]
    if missing:
        raise MeshError(
            f"mesh has dims {names or '(unnamed)'} but diffusers needs both 'ring' and 'ulysses' "
            f"(missing: {missing}); fix: build it with sp_diffusers.build_device_mesh(ulysses_degree, ring_degree)"
        )
    sizes = dict(zip(names, mesh.shape, strict=True))
    for name, degree in (("ulysses", ulysses_degree), ("ring", ring_degree)):
        if sizes[name] != degree:
            raise MeshError(
                f"mesh dim '{name}' has size {sizes[name]} but {name}_degree={degree}; "
                "fix: pass the same degrees to the mesh and to context_parallel_config"
            )


def context_parallel_config(
    ulysses_degree: int,
    ring_degree: int = 1,
    mesh: Any = None,
    **kwargs: Any,
):
    """A ``diffusers.ContextParallelConfig`` that works on every supported diffusers version.

    ``mesh`` may be any DeviceMesh with ``ring`` and ``ulysses`` dims (extra dims such as ``dp`` are fine).
    Without one, when the world is larger than ``ulysses_degree * ring_degree`` (data x sequence
    parallelism), a ``(dp, ring, ulysses)`` mesh is built here, since diffusers' own mesh would span
    the whole world. On diffusers < 0.38, which has no ``mesh=``, the mesh rides on the config and the
    ``mesh_injection`` patch (applied by ``sp_diffusers.install()``) hands it to diffusers.
    """
    check_supported()
    from diffusers import ContextParallelConfig

    if not is_installed():
        raise RuntimeError(
            "sp_diffusers.install() has not run: the ulysses_sdpa backend is not registered and diffusers' "
            "defects are unpatched, so enable_parallelism would fail or be silently wrong on this version. "
            "Fix: call sp_diffusers.install() once per process before context_parallel_config(...)"
        )

    if dist.is_available() and dist.is_initialized():
        dims = ParallelDims.of_process_group(ulysses_degree, ring_degree)
        if mesh is None and dims.dp > 1:
            mesh = dims.build_mesh()
    else:  # no process group yet: the degrees alone
        ParallelDims.check_degrees(ulysses_degree, ring_degree)
    # validated: the degrees are positive ints here
    if ulysses_degree > 1 and ring_degree > 1 and not config_accepts_ulysses_and_ring():
        raise MeshError(
            f"diffusers {diffusers_version()} refuses ulysses_degree={ulysses_degree} together with "
            f"ring_degree={ring_degree} (its ContextParallelConfig has no unified Ulysses x Ring); fix: upgrade "
            "diffusers to >= 0.37, or set one of the two degrees to 1 (a pure ring or pure Ulysses works here)"
        )
    if mesh is not None:
        _check_mesh(mesh, ulysses_degree, ring_degree)

    if mesh is None or config_accepts_mesh():
        extra = {"mesh": mesh} if mesh is not None else {}
        return ContextParallelConfig(
            ring_degree=ring_degree, ulysses_degree=ulysses_degree, **extra, **kwargs
        )

    if not mesh_injection.is_applied():
        raise RuntimeError(
            f"diffusers {diffusers_version()} has no ContextParallelConfig(mesh=...); a shared mesh needs the "
            "mesh_injection patch. Fix: call sp_diffusers.install() before context_parallel_config(...)"
        )
    config = ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree, **kwargs)
    setattr(config, mesh_injection.INJECTED_MESH_ATTR, mesh)
    return config
