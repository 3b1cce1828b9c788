"""Ending a process that used gloo cleanly: its worker threads are joined before the interpreter finalizes.

The abort: ``terminate called without an active exception`` (SIGABRT) as a rank exits, after it did all its
work. Seen most on a rank that never reads its output (nothing follows its last collective), and on a loaded
host. A core dump shows the main thread finalizing the interpreter while a gloo worker thread
(``ProcessGroupGloo::runLoop``) destroys a finished work (``AsyncAllgatherWork``, ``AsyncAlltoallWork``) and
waits for the GIL inside ``TensorImpl::decref_pyobject``; ``take_gil`` sees the interpreter finalizing and
ends the thread with ``pthread_exit``, whose unwinding crosses a ``noexcept`` destructor: ``std::terminate``.

Why a finished work still holds anything: a gloo collective runs on one of the group's worker threads, and
the caller's ``wait()`` returns as soon as that worker marks the work complete; the worker drops its own
reference a moment later. Whichever of the two drops last destroys the work, and on a busy host that is
often the worker. The work holds the collective's tensors, which came from Python; with torch's PyObject
preservation (torch 2.13 measured) releasing a tensor that Python also references decrements its PyObject,
which needs the GIL. While the program runs that costs the worker one GIL hand-off; if the main thread
reaches ``Py_FinalizeEx`` first, the worker dies in the destructor. No particular collective is at fault
(cores show the attention all-to-all and the output all-gather alike), so no change to one collective
removes it; joining the workers while the interpreter is whole does. Only ``ProcessGroupGloo``'s destructor
joins them (its ``shutdown()`` and ``abort()`` do nothing); it runs when the last reference to the group
goes, with the GIL released, so a worker still releasing a work takes the GIL and finishes.
``destroy_process_group()`` alone does not get there: a model's ``DeviceMesh`` keeps its groups
(``_pg_registry``), and a model sits in reference cycles (diffusers' hooks), freed only by the collection
that ``Py_FinalizeEx`` itself runs after finalization has begun - too late.

What the hook does (``atexit``, registered by ``sp_diffusers.install()``; atexit callbacks run before
finalization): if the program left torch.distributed initialized and every group is gloo, it destroys the
groups (what torch asks every program to do before it exits; gloo's teardown is local, no peer is
contacted). It then collects garbage, and drops the references live meshes keep to destroyed gloo groups
(a destroyed group cannot be used again): every group is destructed there, its workers joined while they
can still take the GIL. A program that destroyed its groups itself (torch's advice, diffusers' test
harness) gets the collection and the meshes' part. NCCL (or mixed) groups are left to the program: their
teardown may wait on peers. Not covered: a ``ProcessGroup`` object the program itself still references at
exit (e.g. ``group = dist.new_group(...)`` in a module global); docs/troubleshooting.md says what to do.
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
