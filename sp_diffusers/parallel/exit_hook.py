"""Ending a process that used gloo cleanly: its worker threads are joined before the interpreter finalizes.

Without it a rank that did all its work may abort as it exits (SIGABRT, ``terminate called without an active
exception``): a gloo worker thread still releasing a finished collective's tensors needs the GIL while the main
thread finalizes the interpreter. Only a ``ProcessGroupGloo``'s destructor joins its workers, and a model's
``DeviceMesh`` and reference cycles keep the groups alive until too late (docs/reliability.md, "No abort at
exit", has the diagnosis).

The hook (``atexit``, registered by ``sp_diffusers.install()``; atexit runs before finalization): if the program
left torch.distributed initialized and every group is gloo, it destroys the groups (gloo's teardown is local),
collects garbage and drops the references live meshes keep to destroyed gloo groups, so every group is
destructed while its workers can still take the GIL. NCCL (or mixed) groups are left to the program (their
teardown may wait on peers), as is a ``ProcessGroup`` the program itself still references at exit.
"""

from __future__ import annotations

import atexit
import gc
import logging
import sys
import threading

__all__ = ["register", "unregister"]

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_registered = False


def _gloo_only(dist) -> bool:
    """Every live process group (the default one included) uses gloo alone."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or []) or [None]
    try:
        return all(str(dist.get_backend(g)) == "gloo" for g in groups)
    except Exception:  # a group torch itself no longer resolves: leave every group to the program
        return False


def _is_gloo(pg) -> bool:
    try:
        return pg._get_backend_name() == "gloo"
    except Exception:
        return False


def _forget_destroyed_groups(dist) -> None:
    """Drop live DeviceMeshes' references to destroyed process groups (torch 2.13 keeps them in
    ``DeviceMesh._pg_registry``): a destroyed group cannot be used again, and the reference is what keeps
    its gloo workers running while a model stays alive past the end of the program (a module global)."""
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    mesh_cls = getattr(mesh_module, "DeviceMesh", None)
    if mesh_cls is None:
        return
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None) or {}
    for obj in gc.get_objects():
        if issubclass(type(obj), mesh_cls):  # type(), not isinstance: no lazy proxy is touched
            registry = getattr(obj, "__dict__", {}).get("_pg_registry")
            if isinstance(registry, dict):
                for name in [n for n, pg in registry.items() if pg not in live and _is_gloo(pg)]:
                    del registry[name]  # the last reference: the group's destructor joins its workers


def _at_exit() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return
    try:
        if dist.is_initialized():
            if not _gloo_only(dist):
                return
            dist.destroy_process_group()
        gc.collect()
        _forget_destroyed_groups(dist)
    except Exception as exc:  # never turn a finished run into a failed exit
        logger.warning("sp_diffusers exit hook: %s: %s", type(exc).__name__, exc)


def register() -> None:
    """Join gloo's worker threads at exit (idempotent; ``sp_diffusers.install()`` calls it)."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def unregister() -> None:
    """Undo :func:`register` (``sp_diffusers.uninstall()`` calls it)."""
    global _registered
    with _lock:
        if _registered:
            atexit.unregister(_at_exit)
            _registered = False
