"""diffusers version facts and feature probes (nothing here changes diffusers).

Supported: every diffusers release with ``ContextParallelConfig`` (0.36.0 and newer). Feature checks
look at the installed code, not the version number, wherever the code can tell.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from packaging.version import Version

MIN_DIFFUSERS = Version("0.36.0")

__all__ = [
    "MIN_DIFFUSERS",
    "UnsupportedDiffusersError",
    "check_supported",
    "config_accepts_mesh",
    "config_accepts_ulysses_and_ring",
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
