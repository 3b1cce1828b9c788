"""What the verl-omni patches share: finding verl-omni without importing it, reading its installed source,
and running a fix on one of its modules once that module is imported (at once, if it already is).

verl-omni (``verl-project/verl-omni``) is never imported from here: importing it imports its whole package
tree (pipelines, rollout, vLLM aliases), and the sp-diffusers plugin runs while ``import verl`` is itself
still running, often from inside verl-omni's own import. A fix is therefore registered against a module
name and runs right after that module's code has run, before anyone can use what it defines.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from ..swaps import AttributeSwaps
from ._base import Probe

PACKAGE = "verl_omni"
NOT_INSTALLED = Probe(False, "verl-omni is not installed (nothing of it to patch)")

Fix = Callable[[ModuleType], None]

_hooks: dict[str, list[Fix]] = {}  # module name -> fixes waiting for its import
_pending: set[str] = set()  # hooked modules that were mid-import when their fix was registered


def _package_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec(PACKAGE)  # a top-level lookup: imports nothing
    except (ImportError, ValueError):  # ValueError: a sys.modules entry without a spec (a stub)
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or ()) if spec else []
    return Path(locations[0]) if locations else None


def installed() -> bool:
    """Whether ``import verl_omni`` would find a package (it is not imported)."""
    return _package_dir() is not None


def source(relative: str) -> str | None:
    """The installed text of ``verl_omni/<relative>`` (None when there is no such file), read without
    importing it: probes look at the code that will run."""
    root = _package_dir()
    path = root / relative if root else None
    if path is None or not path.is_file():
        return None
    return path.read_text(encoding="utf-8", errors="replace")


def _initializing(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def when_imported(name: str, fix: Fix) -> None:
    """Run ``fix(module)`` on module ``name``: now if it is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        fix(module)
        return
    _hooks.setdefault(name, []).append(fix)
    if module is not None:  # its code is running (we are inside its import): catch it at the next import
        _pending.add(name)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def forget(fix: Fix) -> None:
    """Drop ``fix`` from every module it waits for (a patch's revert)."""
    for name in list(_hooks):
        _hooks[name] = [f for f in _hooks[name] if f != fix]  # ==: bound methods are made anew per access
        if not _hooks[name]:
            del _hooks[name]
            _pending.discard(name)
    if not _hooks:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def _fire(name: str, module: ModuleType) -> None:
    _pending.discard(name)
    for fix in _hooks.pop(name, []):
        fix(module)  # a failing fix must be loud: the defect it fixes may be a silently wrong result
    if not _hooks:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def _run_pending() -> None:
    for name in list(_pending):
        module = sys.modules.get(name)
        if module is None:  # its import failed
            _pending.discard(name)
        elif not _initializing(module):
            _fire(name, module)


class _Loader(importlib.abc.Loader):
    """The module's own loader, plus the fixes right after its code ran."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _fire(self._name, module)

    def __getattr__(self, attr: str):  # get_source, get_code, is_package, ...: the real loader's
        if attr in ("_loader", "_name"):  # not set yet (copy/pickle): no recursion
            raise AttributeError(attr)
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it and wraps the loader of a hooked module."""

    def find_spec(self, fullname, path=None, target=None):
        _run_pending()
        if fullname not in _hooks:
            return None
        finders = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in finders:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class ImportFix:
    """The apply / revert / is_applied of a verl-omni patch: ``fix`` runs on each of ``modules`` when it is
    imported; revert forgets the hooks and restores what ``swaps`` changed. Idempotent both ways."""

    def __init__(self, modules: tuple[str, ...], fix: Fix, swaps: AttributeSwaps) -> None:
        self.modules, self.fix, self.swaps = modules, fix, swaps
        self.armed = False

    def apply(self) -> None:
        if self.armed:
            return
        self.armed = True
        for name in self.modules:
            when_imported(name, self.fix)

    def revert(self) -> None:
        forget(self.fix)
        self.swaps.restore()
        self.armed = False

    def is_applied(self) -> bool:
        return self.armed
