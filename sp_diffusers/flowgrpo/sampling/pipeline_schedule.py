"""Each family's sampler schedule as its diffusers pipeline builds it at inference, from the real scheduler class.

The reference trainers take their rollout schedule from the model's scheduler, not from a formula of their own:
flow_grpo and verl-omni call ``FlowMatchEulerDiscreteScheduler.set_timesteps`` for SD3, flow_grpo's Wan trainer
keeps the pipeline's ``UniPCMultistepScheduler`` for its sigmas and integer timesteps. So does this module:

- ``pipeline`` schedules build the scheduler class named in the scheduler config (a pipeline folder's
  ``scheduler/scheduler_config.json``, else the family default below) with ``from_config`` (nothing downloaded)
  and call ``set_timesteps`` exactly as the family's pipeline does:

  - SD3 (``StableDiffusion3Pipeline``): ``set_timesteps(N)`` (plus ``mu`` only with dynamic shifting);
    with the default static shift 3 the sigmas are ``shift(linspace(1, shift(1/1000), N))``, last 0.0089;
  - Qwen-Image (``QwenImagePipeline``): ``set_timesteps(sigmas=linspace(1, 1/N, N), mu)`` with
    ``mu = calculate_shift(image tokens, ...)`` from the config, then ``shift_terminal`` 0.02 stretches the end;
  - FLUX.1 (``FluxPipeline``): as Qwen-Image (``linspace(1, 1/N, N)`` sigmas, ``mu`` from the packed image tokens
    and the config's base / max shift), without a terminal stretch in FLUX.1-dev's config;
  - Wan (``WanPipeline``): ``set_timesteps(N)`` on Wan's UniPC config (flow sigmas, ``flow_shift`` 3):
    ``shift(linspace(1, 1/1000, N + 1)[:-1])`` with ``sigmas[0] = 1 - 1e-6`` and truncated integer timesteps.
  - Z-Image (``ZImagePipeline``): ``mu`` from the image tokens as FLUX.1 (ignored by Z-Image-Turbo's static shift
    3), and from diffusers 0.40 ``set_timesteps(sigmas=get_default_z_image_sigmas(N), mu)`` (``linspace(1, 1/N,
    N)``); before 0.40 the pipeline set ``sigma_min = 0`` and called ``set_timesteps(N, mu)``: its last step is at
    sigma 0 and moves nothing. Whichever the installed pipeline does is what this does.
  - FLUX.2 (``Flux2KleinPipeline``, ``Flux2Pipeline``): ``set_timesteps(sigmas=linspace(1, 1/N, N), mu)`` (no
    sigmas where the config sets ``use_flow_sigmas``) with the pipelines' own ``compute_empirical_mu(image tokens,
    N)`` (it depends on the step count too; the config's base / max shift are not read).
  - LTX-2 (``LTX2Pipeline``): as FLUX.1, ``mu`` over the video tokens alone (the audio stream steps on a copy of
    the same scheduler).
  - HunyuanVideo-1.5 (``HunyuanVideo15Pipeline``): ``set_timesteps(sigmas=linspace(1, 0, N + 1)[:-1])``, which the
    scheduler shifts by its static ``shift`` (5 for the 480p checkpoints).

- ``linspace`` schedules are DanceGRPO's (and verl-omni's ``dance_grpo``):
  ``sigmas = shift(linspace(1, 0, N + 1))`` computed in float32, and the model timestep ``int(1000 sigma)``
  (truncated, so 0.875 in float32 gives 874) as DanceGRPO passes it.

The model timestep is kept on the 0..1000 scale the pipelines compute; each adapter converts it the way its
pipeline hands it to the transformer (Qwen-Image divides by 1000).

Beside the sampler's steps a schedule carries the scheduler's *training* grid (``train_sigmas``, its
``num_train_timesteps`` sigmas before ``set_timesteps``): what a flow-matching training loss draws its noise level
from (Diffusion-DPO's logit-normal timesteps). FlowMatchEuler's grid is the scheduler's own (static shift applied
unless it shifts by resolution); UniPC keeps a VP grid until ``set_timesteps``, so its flow grid is
``flow_shift(linspace(1, 1/1000, 1000))``, the same formula.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...families.scheduler_configs import SCHEDULER_DEFAULTS
from ...parallel.devices import to_device
from .schedule import qwenimage_mu

__all__ = [
    "SCHEDULER_DEFAULTS",
    "Schedule",
    "linspace_schedule",
    "load_scheduler_config",
    "pipeline_schedule",
]


@dataclass(frozen=True)
class Schedule:
    """``sigmas [N + 1]`` float32 ending in 0, ``timesteps [N]`` float32 (the model timestep of each step, on the
    0..1000 scale), where they came from (printed once by the trainer), and ``train_sigmas [1000]`` float32, the
    scheduler's training grid from 1 down (module docstring; its model timesteps are ``1000 x`` these)."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    source: str
    train_sigmas: torch.Tensor | None = None
    _copies: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    def on(self, device: torch.device) -> Schedule:
        """This schedule with ``sigmas`` and ``timesteps`` on ``device``, copied once (queued, no host sync) and
        kept: a denoising loop indexes it there instead of copying a step's value from the host each time.
        Read numbers (``float(sigmas[i])``) from the CPU schedule itself: on an accelerator that is a sync."""
        device = torch.device(device)
        if device == self.sigmas.device:
            return self
        if device not in self._copies:
            train = to_device(self.train_sigmas, device) if self.train_sigmas is not None else None
            self._copies[device] = Schedule(
                to_device(self.sigmas, device), to_device(self.timesteps, device), self.source, train
            )
        return self._copies[device]


_SUPPORTED_CLASSES = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")


def load_scheduler_config(path: str | Path, key: str = "flowgrpo.scheduler") -> dict[str, Any]:
    """The scheduler config of a pipeline folder (``<path>/scheduler/scheduler_config.json``) or of a scheduler
    folder (``<path>/scheduler_config.json``); ``key`` names the config key in errors."""
    p = Path(path)
    for candidate in (p / "scheduler" / "scheduler_config.json", p / "scheduler_config.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise FileNotFoundError(
        f"{key}={str(path)!r} has no scheduler/scheduler_config.json nor scheduler_config.json; fix: point it at "
        "a diffusers pipeline folder (save_pretrained / a downloaded model repo) or its scheduler folder, or leave "
        "it empty for the model family's default scheduler"
    )


def _build_scheduler(config: dict[str, Any], shift: float | None):
    import diffusers

    name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if name not in _SUPPORTED_CLASSES:
        raise ValueError(
            f"the scheduler config names {name}; FlowGRPO rollouts need a flow-matching schedule from one of "
            f"{', '.join(_SUPPORTED_CLASSES)} (UniPC with use_flow_sigmas); fix: flowgrpo.scheduler=<a folder with "
            "such a scheduler> or flowgrpo.schedule=linspace"
        )
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if name == "UniPCMultistepScheduler" and not config.get("use_flow_sigmas", False):
        raise ValueError(
            "the UniPCMultistepScheduler config has use_flow_sigmas false: not a flow-matching schedule; fix: use a "
            "flow-matching model's scheduler (Wan: prediction_type flow_prediction, use_flow_sigmas true)"
        )
    if shift is not None:
        if name == "UniPCMultistepScheduler":
            config["flow_shift"] = shift
        elif config.get("use_dynamic_shifting", False):
            raise ValueError(
                f"flowgrpo.shift={shift} has no effect: this scheduler shifts by resolution (use_dynamic_shifting, "
                "mu from the image tokens); fix: flowgrpo.shift=0 (the pipeline's own shift)"
            )
        else:
            config["shift"] = shift
    return getattr(diffusers, name).from_config(config)


def pipeline_schedule(
    kind: str,
    num_steps: int,
    *,
    scheduler_config: dict[str, Any] | None = None,
    image_seq_len: int | None = None,
    shift: float | None = None,
) -> Schedule:
    """The ``num_steps``-step schedule the ``kind`` pipeline (``sd3``, ``qwenimage``, ``flux``, ``flux2``, ``wan``,
    ``zimage``, ``hunyuanvideo15``, ``ltx2``) samples with.

    Args:
        scheduler_config: the pipeline's scheduler config (``load_scheduler_config``); None: the family default.
        image_seq_len: image tokens per sample (after patching); the ``mu`` of Qwen-Image, FLUX.1, FLUX.2, Z-Image
            and a dynamically shifted SD3 depend on it.
        shift: replaces the config's static shift (``shift``, or UniPC's ``flow_shift``); None keeps it.
    """
    if kind not in SCHEDULER_DEFAULTS:
        raise ValueError(
            f"model.kind={kind!r} has no pipeline schedule here; known: {', '.join(SCHEDULER_DEFAULTS)}; fix: "
            "flowgrpo.schedule=linspace (DanceGRPO's shifted linspace, flowgrpo.shift) for other families"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"flowgrpo.num_steps must be an int >= 2, got {num_steps!r}")
    config = dict(scheduler_config if scheduler_config is not None else SCHEDULER_DEFAULTS[kind])
    scheduler = _build_scheduler(config, shift)
    name = type(scheduler).__name__
    c = scheduler.config
    if name == "FlowMatchEulerDiscreteScheduler":  # its grid before set_timesteps replaces it
        train = scheduler.sigmas.detach().cpu().to(torch.float32).clone()
    else:  # UniPC: a VP grid until set_timesteps; its flow grid by the same formula
        train = _shifted_grid(int(c.get("num_train_timesteps", 1000)), float(c.get("flow_shift", 1.0)))
    dynamic = name == "FlowMatchEulerDiscreteScheduler" and bool(c.get("use_dynamic_shifting", False))
    flux_like = kind in ("qwenimage", "flux", "ltx2")  # the pipelines pass linspace(1, 1/N, N) sigmas and mu
    if (flux_like or kind in ("zimage", "flux2") or (kind == "sd3" and dynamic)) and image_seq_len is None:
        raise ValueError(f"the {kind} pipeline schedule depends on the image tokens: pass image_seq_len")
    if kind == "flux2":  # the FLUX.2 pipelines' own mu, of the image tokens and the step count
        mu = _flux2_mu(image_seq_len, num_steps)
    elif flux_like or kind == "zimage" or (kind == "sd3" and dynamic):
        # the pipelines' calculate_shift fallbacks differ (Qwen-Image 1.15, SD3 1.16 as max_shift; LTX-2's own four,
        # over its video tokens)
        base_len, base_shift, max_shift = (1024, 0.95, 2.05) if kind == "ltx2" else (256, 0.5, 1.16 if kind == "sd3" else 1.15)
        mu = qwenimage_mu(
            image_seq_len,
            c.get("base_image_seq_len", base_len),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", base_shift),
            c.get("max_shift", max_shift),
        )
    else:
        mu = None
    if flux_like or (kind == "flux2" and not c.get("use_flow_sigmas", False)):
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    elif kind == "zimage":
        _set_zimage_timesteps(scheduler, num_steps, mu)
    elif kind == "hunyuanvideo15":  # HunyuanVideo15Pipeline: linspace(1, 0, N + 1)[:-1], shifted by the scheduler
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1])
    elif mu is not None:
        scheduler.set_timesteps(num_steps, mu=mu)
    else:
        scheduler.set_timesteps(num_steps)  # SD3 without dynamic shifting, and Wan (UniPC or FlowMatch)
    sigmas = scheduler.sigmas.detach().cpu().to(torch.float32)
    timesteps = scheduler.timesteps.detach().cpu().to(torch.float32)
    origin = "the pipeline folder's" if scheduler_config is not None else f"the {kind} default"
    return Schedule(
        sigmas, timesteps, f"{name} ({origin} scheduler config), as the {kind} pipeline sets it", train
    )


def _set_zimage_timesteps(scheduler: Any, num_steps: int, mu: float | None) -> None:
    """``set_timesteps`` as the installed ``ZImagePipeline.__call__`` calls it (module docstring)."""
    from diffusers.pipelines.z_image import pipeline_z_image

    default_sigmas = getattr(pipeline_z_image, "get_default_z_image_sigmas", None)
    if default_sigmas is not None:  # diffusers >= 0.40
        scheduler.set_timesteps(sigmas=default_sigmas(num_steps), mu=mu)
    else:  # the pipeline stretched the scheduler's range to sigma 0 first
        scheduler.sigma_min = 0.0
        scheduler.set_timesteps(num_steps, mu=mu)


def _flux2_mu(image_seq_len: int, num_steps: int) -> float:
    """``mu`` as the installed ``Flux2KleinPipeline.__call__`` / ``Flux2Pipeline.__call__`` compute it
    (``compute_empirical_mu``: an empirical fit in the image tokens and the step count)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)


def _shifted_grid(num_train_timesteps: int, shift: float) -> torch.Tensor:
    """``shift(linspace(1, 1/n, n))`` as FlowMatchEulerDiscreteScheduler builds its training grid (float32)."""
    n = num_train_timesteps
    s = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy()) / n
    return shift * s / (1 + (shift - 1) * s)


def linspace_schedule(num_steps: int, shift: float) -> Schedule:
    """DanceGRPO's schedule: ``shift * t / (1 + (shift - 1) t)`` over ``t = linspace(1, 0, N + 1)`` in float32,
    model timesteps ``int(1000 sigma)`` (truncated)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"flowgrpo.num_steps must be an int >= 2, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(
            f"flowgrpo.shift must be > 0 for flowgrpo.schedule=linspace, got {shift!r}; DanceGRPO uses 3 (Wan 2.1, "
            "Flux, Qwen-Image) or 5 (HunyuanVideo; verl-omni's Wan 2.2)"
        )
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    sigmas = shift * t / (1.0 + (shift - 1.0) * t)
    timesteps = (sigmas[:-1] * 1000.0).to(torch.int64).to(torch.float32)
    return Schedule(
        sigmas,
        timesteps,
        f"DanceGRPO's shifted linspace (shift {shift:g}), int(1000 sigma) timesteps",
        _shifted_grid(1000, shift),
    )
