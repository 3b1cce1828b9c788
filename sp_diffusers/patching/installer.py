"""``install()`` / ``uninstall()``: register the backend and apply exactly the patches diffusers needs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..parallel import exit_hook
from .backend_registration import BACKEND_NAME, register_backend, unregister_backend
from .compat import check_supported

__all__ = ["InstallReport", "PatchStatus", "install", "is_installed", "uninstall"]

_lock = threading.Lock()
_report: InstallReport | None = None


@dataclass(frozen=True)
class PatchStatus:
    name: str
    applied: bool
    reason: str
    affected: str
    upstream: str


@dataclass(frozen=True)
class InstallReport:
    """What ``install()`` did: diffusers' version, the backend, each patch applied or skipped and why."""

    diffusers_version: str
    backend: str
    patches: tuple[PatchStatus, ...] = field(default_factory=tuple)
    plans: tuple = field(default_factory=tuple)  # sp_diffusers.patching.plans.PlanStatus

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.patches if p.applied)

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.patches if not p.applied)

    def __str__(self) -> str:
        lines = [
            f"sp-diffusers install: diffusers {self.diffusers_version}",
            f"  backend   {self.backend!r} registered (context-parallel capable)",
        ]
        for p in self.patches:
            verb = "applied" if p.applied else "skipped"
            lines.append(f"  {verb:<9} {p.name:<22} {p.reason}")
        for plan in self.plans:
            verb = "plan" if plan.attached else "no plan"
            lines.append(f"  {verb:<9} {plan.model_class:<22} {plan.reason}")
        return "\n".join(lines)


def install() -> InstallReport:
    """Register ``ulysses_sdpa`` with diffusers and apply the patches the installed version needs.

    Idempotent: a second call changes nothing and returns the same report. Importing ``sp_diffusers``
    patches nothing; only this call does. It also registers an exit hook that joins gloo's worker threads
    before the interpreter finalizes (``sp_diffusers.parallel.exit_hook``).
    """
    global _report
    with _lock:
        if _report is not None:
            return _report
        from . import plans, scope_hooks
        from .patches import ALL_PATCHES

        version = check_supported()
        register_backend()
        statuses = []
        try:
            for patch in ALL_PATCHES:
                result = patch.probe()
                if result.needed:
                    patch.apply()
                statuses.append(
                    PatchStatus(patch.NAME, result.needed, result.reason, patch.AFFECTED, patch.UPSTREAM)
                )
            plan_statuses = plans.attach()
            scope_hooks.install()
        except Exception:
            scope_hooks.uninstall()
            plans.detach()
            for patch in reversed(ALL_PATCHES):
                patch.revert()
            unregister_backend()
            raise
        _report = InstallReport(str(version), BACKEND_NAME, tuple(statuses), tuple(plan_statuses))
        exit_hook.register()  # a gloo rank that ends right after its last collective must not abort at exit
        return _report


def _processors_using_backend() -> list[str]:
    """Class names of the attention modules of live models whose processor dispatches to ``ulysses_sdpa``."""
    import gc

    import torch

    gc.collect()  # models dropped by the caller but still in a reference cycle do not count
    users = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.nn.Module):  # type(), not isinstance: no lazy proxy is touched
            backend = getattr(obj.__dict__.get("processor"), "_attention_backend", None)
            if backend is not None and getattr(backend, "value", backend) == BACKEND_NAME:
                users.append(type(obj).__name__)
    return users


def uninstall() -> None:
    """Revert every patch (newest first) and remove the backend from diffusers. Idempotent.

    Refused while a live model still uses ``ulysses_sdpa``: its next forward would fail inside diffusers with a
    bare ``KeyError``. Call ``model.reset_attention_backend()`` (or drop the model) first.
    """
    global _report
    with _lock:
        if _report is not None:
            users = _processors_using_backend()
            if users:
                raise RuntimeError(
                    f"sp_diffusers.uninstall(): {len(users)} attention module(s) of live models still use "
                    f"{BACKEND_NAME!r} ({', '.join(sorted(set(users)))}), and their next forward would fail "
                    "inside diffusers; fix: model.reset_attention_backend() (or set_attention_backend('native')) "
                    "on those models first, or drop them (del model), then uninstall()"
                )
        from . import plans, scope_hooks
        from .patches import ALL_PATCHES

        scope_hooks.uninstall()
        plans.detach()
        for patch in reversed(ALL_PATCHES):
            patch.revert()
        unregister_backend()
        exit_hook.unregister()
        _report = None


def is_installed() -> bool:
    return _report is not None
