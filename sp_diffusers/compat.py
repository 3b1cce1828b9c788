"""diffusers version facts and feature probes; building a ``ContextParallelConfig`` that works everywhere.

Supported: every diffusers release with ``ContextParallelConfig`` (0.36.0 and newer). Feature checks
look at the installed code, not the version number, wherever the code can tell.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import torch.distributed as dist
from packaging.version import Version

from .mesh import MeshError, build_device_mesh, validate_degrees

MIN_DIFFUSERS = Version("0.36.0")
# The attribute that carries a shared mesh on versions whose ContextParallelConfig has no `mesh` field;
# the `mesh_injection` patch hands it to diffusers inside `enable_parallelism`.
INJECTED_MESH_ATTR = "_sp_diffusers_mesh"

__all__ = [
    "MIN_DIFFUSERS",
    "UnsupportedDiffusersError",
    "check_supported",
    "config_accepts_mesh",
    "context_parallel_config",
    "diffusers_version",
]


class UnsupportedDiffusersError(RuntimeError):
    """The installed diffusers cannot do context parallelism."""


@cache
def diffusers_version() -> Version:
    import diffusers

    return Version(Version(diffusers.__version__).base_version)


def check_supported() -> Version:
    """Raise a clear error when the installed diffusers predates context parallelism."""
    version = diffusers_version()
    try:
        from diffusers.models._modeling_parallel import ContextParallelConfig
    except ImportError:
        ContextParallelConfig = None
    if version < MIN_DIFFUSERS or ContextParallelConfig is None:
        raise UnsupportedDiffusersError(
            f"diffusers {version} is not supported: sp-diffusers needs diffusers >= {MIN_DIFFUSERS} "
            "(the first release with ContextParallelConfig). Fix: pip install 'diffusers>=0.36'"
        )
    return version


def config_accepts_mesh() -> bool:
    """Whether ``ContextParallelConfig`` takes ``mesh=`` (diffusers >= 0.38)."""
    from diffusers import ContextParallelConfig

    return "mesh" in {f.name for f in dataclasses.fields(ContextParallelConfig)}


@cache
def config_accepts_ulysses_and_ring() -> bool:
    """Whether ``ContextParallelConfig`` accepts ulysses > 1 and ring > 1 together (0.36 refuses it in
    its constructor; only the constructor is probed, nothing distributed runs)."""
    from diffusers import ContextParallelConfig

    try:
        ContextParallelConfig(ring_degree=2, ulysses_degree=2)
    except ValueError:
        return False
    return True


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

    from .installer import is_installed

    if not is_installed():
        raise RuntimeError(
            "sp_diffusers.install() has not run: the ulysses_sdpa backend is not registered and diffusers' "
            "defects are unpatched, so enable_parallelism would fail or be silently wrong on this version. "
            "Fix: call sp_diffusers.install() once per process before context_parallel_config(...)"
        )

    if dist.is_available() and dist.is_initialized():
        validate_degrees(dist.get_world_size(), ulysses_degree, ring_degree)
        if mesh is None and dist.get_world_size() != ulysses_degree * ring_degree:
            mesh = build_device_mesh(ulysses_degree, ring_degree)
    else:
        validate_degrees(ulysses_degree * ring_degree, ulysses_degree, ring_degree)
    # after validate_degrees: the degrees are positive ints here
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

    from .patches import mesh_injection

    if not mesh_injection.is_applied():
        raise RuntimeError(
            f"diffusers {diffusers_version()} has no ContextParallelConfig(mesh=...); a shared mesh needs the "
            "mesh_injection patch. Fix: call sp_diffusers.install() before context_parallel_config(...)"
        )
    config = ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree, **kwargs)
    setattr(config, INJECTED_MESH_ATTR, mesh)
    return config
