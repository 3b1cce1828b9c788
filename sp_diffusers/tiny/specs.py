"""The tiny-model registry: per kind, a small constructor config and a function that builds fitting inputs."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..families.kinds import model_class

__all__ = [
    "InputRequest",
    "TinyKind",
    "accepted_config",
    "register",
    "text_mask",
    "tiny_inputs",
    "tiny_model",
    "tiny_model_config",
]


class InputRequest(NamedTuple):
    """What a kind's input builder is asked for: the generator, the timesteps ``[B]`` in [0, 1000), the batch, the
    (padded) text length, the latent height/width before patching, the frames, a ragged text mask or a full one."""

    g: torch.Generator
    t: torch.Tensor
    batch: int
    text_len: int
    image_hw: tuple[int, int]
    frames: int
    ragged_text: bool


@dataclass(frozen=True)
class TinyKind:
    config: Callable[[], dict[str, Any]]  # the constructor kwargs
    inputs: Callable[..., dict[str, Any]]  # (model, InputRequest, **options) -> kwargs
    options: tuple[str, ...] = ()  # the kind's own input options (e.g. "per_token_timestep"), passed by name


_KINDS: dict[str, TinyKind] = {}


def register(kind: str, tiny: TinyKind) -> None:
    _KINDS[kind] = tiny


def _get(kind: str) -> TinyKind:
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} is not a tiny model; choose one of {tuple(_KINDS)}")
    return _KINDS[kind]


def accepted_config(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the keys the installed class's ``__init__`` does not take: one tiny config serves
    every diffusers version of a class whose constructor grew options (LTX-2, Flux.2)."""
    params = inspect.signature(model_class(kind).__init__).parameters
    return {k: v for k, v in config.items() if k in params}


# the generic layer-count keyword -> what a class names it (Z-Image: n_layers), so one override serves every kind
_LAYER_KEYS = ("num_layers", "n_layers")


def tiny_model_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """The constructor kwargs of the tiny ``kind`` model (``overrides`` replace defaults; ``num_layers`` is the
    layer count whatever the class calls it). A key the class does not take is refused by name."""
    params = inspect.signature(model_class(kind).__init__).parameters
    if "num_layers" in overrides and "num_layers" not in params:
        alias = next((k for k in _LAYER_KEYS if k in params), None)
        if alias is not None:
            overrides = {alias: overrides["num_layers"], **{k: v for k, v in overrides.items() if k != "num_layers"}}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(k for k in overrides if k not in params and not takes_any)
    if unknown:
        keys = ", ".join(k for k in params if k != "self")
        raise ValueError(
            f"model.overrides: the tiny {kind} model ({model_class(kind).__name__}) takes no {', '.join(unknown)}; "
            f"fix: use its constructor's keys ({keys})"
        )
    return {**_get(kind).config(), **overrides}


def tiny_model(
    kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> torch.nn.Module:
    """A randomly initialised tiny ``kind`` transformer (identical on every rank for the same seed)."""
    cls = model_class(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**tiny_model_config(kind, **overrides))
        # Some blocks zero-initialise their output projections (adaLN-zero); random weights make every
        # parameter matter for gradient checks.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2)
    return model if dtype == torch.float32 else model.to(dtype)


def text_mask(batch: int, text_len: int, generator: torch.Generator) -> torch.Tensor:
    """Ragged bool key-padding mask: the first sample is full, the others shorter (never empty)."""
    lengths = [
        text_len,
        *torch.randint(max(1, text_len // 3), text_len, (batch - 1,), generator=generator).tolist(),
    ]
    return torch.arange(text_len)[None, :] < torch.tensor(lengths)[:, None]


def tiny_inputs(
    kind: str,
    model: torch.nn.Module,
    batch: int = 2,
    seed: int = 0,
    text_len: int = 8,
    image_hw: tuple[int, int] = (8, 8),
    frames: int = 2,
    ragged_text: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Forward kwargs for the tiny model (identical on every rank for the same seed).

    ``image_hw`` is the latent height/width before patching; ``text_len`` the (padded) text length;
    ``options`` are the kind's own (``TinyKind.options``, e.g. ``per_token_timestep`` or ``audio_len``).
    """
    tiny = _get(kind)
    unknown = sorted(set(options) - set(tiny.options))
    if unknown:
        raise ValueError(
            f"tiny_inputs({kind!r}) takes no option(s) {unknown}; its options are {list(tiny.options)}"
        )
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    t = torch.rand(batch, generator=g) * 1000.0
    inputs = tiny.inputs(model, InputRequest(g, t, batch, text_len, image_hw, frames, ragged_text), **options)
    return {k: _cast(v, dtype) for k, v in inputs.items()}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors (also inside lists, as Z-Image takes per-sample lists) to the model's dtype."""
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value
