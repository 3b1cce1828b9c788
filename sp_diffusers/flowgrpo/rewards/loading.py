"""Rewards a user brings: ``flowgrpo.rewards`` entries -> ``RewardSpec`` (a loaded callable, its weight, input and
keyword arguments), checked at start-up with errors that name the entry and the fix.

An entry::

    {fn: "pkg.module:callable" | "path/to/file.py:callable" | color | video_color | mean_latent,
     weight: 1.0, input: pixels | latents, kwargs: {...}, name: "..."}

or ``{url: "http://host:port", timeout: 60, retries: 2, ...}`` instead of ``fn``: the function a reward server
serves (``remote.py``).

``fn`` is imported on every rank (a file path is read relative to the working directory). The callable is called as
``fn(images_or_latents, prompts, metadata, **kwargs)`` and returns one float per sample (a tensor, an array or a
list): ``images`` are ``[b, 3, H, W]`` (video ``[b, F, 3, H, W]``) float32 in [0, 1], decoded with the pipeline's
VAE; ``latents`` are the final latents channels last (``[b, L, C]`` for images, ``[b, F, H, W, C]`` for video).
``metadata`` is each sample's dataset row without its prompt (``{}`` for a ``.txt`` prompt file). How the set is
scored (split over the SP group, every rank told about a failure): ``reward_scoring.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .builtin import ColorLatentReward, MeanLatentReward, VideoColorReward

__all__ = ["BUILTIN_REWARDS", "INPUTS", "RewardSpec", "entry_input", "entry_name", "load_callable", "reward_specs"]

INPUTS = ("pixels", "latents")
_KEYS = ("fn", "url", "timeout", "retries", "weight", "input", "kwargs", "name")


def _builtin(cls: type) -> Callable[..., Callable[..., torch.Tensor]]:
    """A built-in latent reward in the (latents, prompts, metadata, **kwargs) form; built once per channel count."""
    cache: dict[Any, Any] = {}

    def reward(latents: torch.Tensor, prompts: list[str], metadata: list[dict], **kwargs: Any) -> torch.Tensor:
        key = (latents.shape[-1], tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = cls(**kwargs) if cls is MeanLatentReward else cls(latents.shape[-1], **kwargs)
        return cache[key](latents, prompts)

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


# the rewards that need no code of yours (latents only): flowgrpo.reward names them, so can an entry's fn
BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "color": _builtin(ColorLatentReward),
    "video_color": _builtin(VideoColorReward),
    "mean_latent": _builtin(MeanLatentReward),
}


@dataclass(frozen=True)
class RewardSpec:
    """One loaded reward. ``name`` keys its metric (``reward/<name>``); ``ref`` is what the config said."""

    name: str
    ref: str
    fn: Callable[..., Any]
    weight: float = 1.0
    input: str = "pixels"
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """How errors name it: ``'name' (ref)``."""
        return f"{self.name!r} ({self.ref})" if self.name != self.ref else repr(self.ref)


def _load_file(path: Path, key: str, ref: str) -> Any:
    resolved = path.resolve()
    module_name = "sp_diffusers_reward_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if module_name in sys.modules:  # one module per file, however many entries name it
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{key}={ref!r}: {path} cannot be imported as a Python file; fix: a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ConfigError(f"{key}={ref!r}: importing {path} raised {type(err).__name__}: {err}") from err
    return module


# modules users name in their configs that moved when flowgrpo/ was split into folders
MOVED = {"sp_diffusers.flowgrpo.clip_reward": "sp_diffusers.flowgrpo.rewards.clip"}


def load_callable(ref: str, key: str = "flowgrpo.rewards[0].fn") -> Callable[..., Any]:
    """``"pkg.module:callable"``, ``"path/to/file.py:callable"`` (relative to the working directory) or a built-in
    name -> the callable; ``key`` names the config key in errors."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{key} must be a string 'pkg.module:callable' or 'path/to/file.py:callable', got {ref!r}")
    if ref in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[ref]
    where, sep, attr = ref.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(
            f"{key}={ref!r} names no callable; fix: 'pkg.module:callable' or 'path/to/file.py:callable' (or a "
            f"built-in: {', '.join(BUILTIN_REWARDS)})"
        )
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ConfigError(
                f"{key}={ref!r}: no file {where} (from the working directory {Path.cwd()}); fix: an existing .py "
                "file, or an absolute path"
            )
        module = _load_file(path, key, ref)
    else:
        if where in MOVED:  # a config written before flowgrpo/ was split into folders keeps working
            warnings.warn(f"{key}={ref!r}: {where} is now {MOVED[where]}; fix: name that module", stacklevel=2)
            where = MOVED[where]
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ConfigError(
                f"{key}={ref!r}: cannot import module {where!r} ({err}); fix: install it, or put its folder on "
                "PYTHONPATH, or give a file path 'path/to/file.py:callable'"
            ) from err
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ConfigError(f"{key}={ref!r}: {where} has no {attr!r}; its callables: {', '.join(public) or 'none'}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{key}={ref!r}: {attr} is a {type(fn).__name__}, not a callable")
    return fn


def entry_input(entry: Any) -> str | None:
    """What a ``flowgrpo.rewards`` entry reads, without importing it: its ``input``, else ``latents`` for a built-in
    and ``pixels`` for a function of yours (None: not an entry; ``reward_specs`` says why)."""
    if isinstance(entry, str):
        entry = {"fn": entry}
    if not isinstance(entry, dict):
        return None
    return entry.get("input", "latents" if entry.get("fn") in BUILTIN_REWARDS else "pixels")


def entry_name(entry: Any) -> str:
    """How a ``flowgrpo.rewards`` entry is named before it is imported: its ``name``, else the callable's name in
    its ``fn`` (what ``__name__`` usually is)."""
    if isinstance(entry, dict):
        return str(entry.get("name") or entry.get("url") or str(entry.get("fn")).rpartition(":")[2])
    return str(entry).rpartition(":")[2]


def _entry(i: int, entry: Any) -> RewardSpec:
    prefix = f"flowgrpo.rewards[{i}]"
    if isinstance(entry, str):
        entry = {"fn": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{prefix} must be a mapping {{fn: ..., weight: ..., input: ...}}, got {entry!r}")
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{prefix} has unknown key(s) {unknown}; valid: {', '.join(_KEYS)}")
    if ("fn" in entry) == ("url" in entry):
        raise ConfigError(
            f"{prefix} needs one of fn (a callable: 'pkg.module:callable' or 'path/to/file.py:callable') or url (a "
            "reward server: `sp-diffusers reward-server`), not both"
        )
    if "url" in entry:
        ref, fn = entry["url"], _remote(prefix, entry)
    else:
        ref = entry["fn"]
        fn = load_callable(ref, f"{prefix}.fn")
        extra = sorted({"timeout", "retries"} & set(entry))
        if extra:
            raise ConfigError(f"{prefix}: {extra} apply to a url entry; fix: drop them, or serve the fn and give url")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ConfigError(f"{prefix}.weight={weight!r} must be a finite number (the total is the weighted sum)")
    builtin = ref in BUILTIN_REWARDS
    kind = entry_input(entry)
    if kind not in INPUTS:
        raise ConfigError(f"{prefix}.input={kind!r}: choose 'pixels' (decoded by the pipeline's VAE) or 'latents'")
    if builtin and kind != "latents":
        raise ConfigError(f"{prefix}: the built-in reward {ref!r} reads latents; fix: input: latents (or leave it out)")
    kwargs = entry.get("kwargs", {}) or {}
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{prefix}.kwargs must be a mapping of keyword arguments, got {kwargs!r}")
    name = entry.get("name") or (ref if builtin else getattr(fn, "__name__", ref))
    if not isinstance(name, str):
        raise ConfigError(f"{prefix}.name must be a string, got {name!r}")
    return RewardSpec(name=name, ref=ref, fn=fn, weight=float(weight), input=kind, kwargs=dict(kwargs))


def _remote(prefix: str, entry: dict) -> Callable[..., Any]:
    from .remote import RemoteReward

    url, timeout, retries = entry["url"], entry.get("timeout", 60.0), entry.get("retries", 2)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{prefix}.url={url!r} must be http://host:port (where `sp-diffusers reward-server` listens)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"{prefix}.timeout={timeout!r} must be seconds > 0 (one request, per try)")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"{prefix}.retries={retries!r} must be an int >= 0 (tries after the first)")
    return RemoteReward(url, float(timeout), retries)


def reward_specs(rewards: list[Any], default: str) -> list[RewardSpec]:
    """``flowgrpo.rewards`` as loaded specs; an empty list means the built-in ``flowgrpo.reward`` (``default``)."""
    if not rewards:
        if default not in BUILTIN_REWARDS:
            raise ConfigError(
                f"flowgrpo.reward={default!r} is not built in; choose one of {', '.join(BUILTIN_REWARDS)}, or list "
                "your own under flowgrpo.rewards ({fn: 'pkg.module:callable', weight: 1.0, input: pixels})"
            )
        return [RewardSpec(name=default, ref=default, fn=BUILTIN_REWARDS[default], input="latents")]
    specs = [_entry(i, e) for i, e in enumerate(rewards)]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"flowgrpo.rewards: the name(s) {duplicates} are used twice (each reward's metric is reward/<name>); "
            "fix: give the entries distinct name: keys"
        )
    return specs
