"""The rollout side: sp-diffusers' SP settings as vllm-omni's, validated, with trainer/rollout consistency checks.

Pure data and validation: this module imports without vllm-omni (it cannot share an environment with
verl 0.9.1). ``scripts/check_vllm_omni.sh`` checks, in a separate environment, that these settings are
accepted by vllm-omni 0.30's real ``DiffusionParallelConfig`` and that ``ulysses_sdpa``'s attention forward
equals vllm-omni's ``UlyssesParallelAttention`` on the same inputs.

vllm-omni describes sequence parallelism with ``DiffusionParallelConfig(ulysses_degree, ring_degree,
sequence_parallel_size = ulysses x ring, ulysses_mode, cfg_parallel_size, ...)`` inside
``OmniDiffusionConfig.parallel_config``; verl-omni passes the same fields as
``actor_rollout_ref.rollout.engine_kwargs.vllm_omni.<field>``. For RL the rollout's attention must compute
the function the trainer's computes, or the trainer's recomputed old log-probs drift from the rollout's:
``check_consistency`` warns (``RolloutMismatchWarning``) where they would differ.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

ENGINE_KWARGS_PREFIX = "actor_rollout_ref.rollout.engine_kwargs.vllm_omni"
ULYSSES_MODES = ("strict", "advanced_uaa")
# vllm-omni attention backends that compute exact softmax attention (rounding aside)
EXACT_BACKENDS = ("TORCH_SDPA", "FLASH_ATTN", "SDPA", "FLASH_ATTENTION", "")

__all__ = [
    "ENGINE_KWARGS_PREFIX",
    "RolloutConfigError",
    "RolloutMismatchWarning",
    "RolloutParallelSettings",
    "check_consistency",
    "rollout_settings",
    "settings_from_engine_kwargs",
    "validate",
]


class RolloutConfigError(ValueError):
    """A rollout setting vllm-omni would refuse or that cannot match the trainer; names parameter, value, fix."""


class RolloutMismatchWarning(UserWarning):
    """The rollout's attention would not compute the trainer's function (old log-probs would drift)."""


@dataclass(frozen=True)
class RolloutParallelSettings:
    """vllm-omni's sequence-parallel fields (``DiffusionParallelConfig``), with verl-omni's key names."""

    ulysses_degree: int = 1
    ring_degree: int = 1
    sequence_parallel_size: int | None = None  # None: ulysses_degree * ring_degree
    ulysses_mode: str = "strict"
    cfg_parallel_size: int = 1
    tensor_parallel_size: int = 1

    @property
    def sp_size(self) -> int:
        return self.sequence_parallel_size or self.ulysses_degree * self.ring_degree

    def parallel_config_kwargs(self) -> dict[str, Any]:
        """``DiffusionParallelConfig(**kwargs)`` (vllm_omni.diffusion.data), sequence_parallel_size filled in."""
        out = dataclasses.asdict(self)
        out["sequence_parallel_size"] = self.sp_size
        return out

    def engine_kwargs(self) -> dict[str, Any]:
        """The ``actor_rollout_ref.rollout.engine_kwargs.vllm_omni`` mapping verl-omni forwards to vllm-omni."""
        return self.parallel_config_kwargs()

    def overrides(self, prefix: str = ENGINE_KWARGS_PREFIX) -> list[str]:
        """The same as hydra overrides (``<prefix>.ulysses_degree=2``, ...)."""
        return [f"{prefix}.{k}={v}" for k, v in self.engine_kwargs().items()]

    @property
    def world_size(self) -> int:
        """GPUs one rollout replica needs: tp x sp x cfg."""
        return self.tensor_parallel_size * self.sp_size * self.cfg_parallel_size


def _error(parameter: str, value: Any, problem: str, fix: str) -> RolloutConfigError:
    return RolloutConfigError(f"{parameter}={value!r}: {problem}; fix: {fix}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _error(
            f"{ENGINE_KWARGS_PREFIX}.{name}", value, "must be a positive int", f"set {name} to 1 or more"
        )


def validate(
    settings: RolloutParallelSettings,
    *,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    image_tokens: int | None = None,
    rollout_world_size: int | None = None,
) -> RolloutParallelSettings:
    """Check ``settings`` as vllm-omni 0.30 would, plus the model facts it needs; returns them unchanged.

    ``num_attention_heads`` (and GQA's ``num_key_value_heads``) must divide ``ulysses_degree`` and
    ``image_tokens`` must divide ``sequence_parallel_size`` in ``strict`` mode; ``rollout_world_size`` (the
    GPUs of one rollout replica) must be a multiple of tp x sp x cfg.
    """
    p = ENGINE_KWARGS_PREFIX
    for name in ("ulysses_degree", "ring_degree", "cfg_parallel_size", "tensor_parallel_size"):
        _positive_int(name, getattr(settings, name))
    if settings.sequence_parallel_size is not None:
        _positive_int("sequence_parallel_size", settings.sequence_parallel_size)
        product = settings.ulysses_degree * settings.ring_degree
        if settings.sequence_parallel_size != product:
            raise _error(
                f"{p}.sequence_parallel_size",
                settings.sequence_parallel_size,
                f"must equal ulysses_degree x ring_degree = {settings.ulysses_degree} x {settings.ring_degree} "
                f"= {product}",
                f"set sequence_parallel_size={product} or leave it unset",
            )
    if settings.ulysses_mode not in ULYSSES_MODES:
        raise _error(
            f"{p}.ulysses_mode",
            settings.ulysses_mode,
            f"must be one of {ULYSSES_MODES}",
            "ulysses_mode=strict",
        )
    strict = settings.ulysses_mode == "strict"
    for name, heads in (
        ("num_attention_heads", num_attention_heads),
        ("num_key_value_heads", num_key_value_heads),
    ):
        if strict and heads is not None and heads % settings.ulysses_degree:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            raise _error(
                f"{p}.ulysses_degree",
                settings.ulysses_degree,
                f"the model's {name}={heads} is not divisible by it (vllm-omni's strict Ulysses splits heads evenly)",
                f"pick ulysses_degree among {divisors}, or ulysses_mode=advanced_uaa",
            )
    if strict and image_tokens is not None and image_tokens % settings.sp_size:
        raise _error(
            f"{p}.sequence_parallel_size",
            settings.sp_size,
            f"the image/video token count {image_tokens} is not divisible by it",
            "choose a resolution whose token count is a multiple of the SP degree, or ulysses_mode=advanced_uaa",
        )
    if rollout_world_size is not None and rollout_world_size % settings.world_size:
        raise _error(
            "rollout_world_size (GPUs per rollout replica)",
            rollout_world_size,
            f"not a multiple of tp x sp x cfg = {settings.world_size}",
            f"give each rollout replica a multiple of {settings.world_size} GPUs or lower the degrees",
        )
    return settings


def rollout_settings(
    ulysses_sequence_parallel_size: int,
    *,
    ring_degree: int = 1,
    cfg_parallel_size: int = 1,
    ulysses_mode: str = "strict",
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    image_tokens: int | None = None,
) -> RolloutParallelSettings:
    """The rollout settings that mirror the trainer's SP degree (validated).

    ``ulysses_sequence_parallel_size`` is the trainer's flag (verl's name); the rollout uses the same Ulysses
    degree so both split the sequence the same way (any degree computes the same function; the same one
    also keeps the per-rank memory profile the trainer was sized for).
    """
    settings = RolloutParallelSettings(
        ulysses_degree=ulysses_sequence_parallel_size,
        ring_degree=ring_degree,
        sequence_parallel_size=ulysses_sequence_parallel_size * ring_degree,
        ulysses_mode=ulysses_mode,
        cfg_parallel_size=cfg_parallel_size,
    )
    return validate(
        settings,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        image_tokens=image_tokens,
    )


def settings_from_engine_kwargs(kwargs: dict[str, Any]) -> RolloutParallelSettings:
    """``actor_rollout_ref.rollout.engine_kwargs.vllm_omni`` (a mapping) -> settings; unknown fields refused."""
    names = {f.name for f in dataclasses.fields(RolloutParallelSettings)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        import difflib

        close = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
        hint = ", ".join(f"{k} (did you mean {c[0]}?)" if c else k for k, c in close.items())
        raise _error(
            f"{ENGINE_KWARGS_PREFIX}.{unknown[0]}",
            kwargs[unknown[0]],
            f"not a sequence-parallel field sp-diffusers checks: {hint}",
            f"use one of {sorted(names)}",
        )
    return validate(RolloutParallelSettings(**kwargs))


def check_consistency(
    rollout: RolloutParallelSettings,
    *,
    trainer_dtype: str = "fp32",
    rollout_dtype: str = "bf16",
    rollout_attention_backend: str = "",
    uses_attention_mask: bool = True,
    warn: bool = True,
) -> list[str]:
    """Where the rollout's attention would compute another function than the trainer's ``ulysses_sdpa``.

    Returns the reasons (and warns with ``RolloutMismatchWarning`` unless ``warn=False``). A different
    Ulysses degree alone is not one: Ulysses attention is exact at any degree.
    """
    reasons = []
    if rollout.ring_degree > 1 and uses_attention_mask:
        reasons.append(
            f"rollout ring_degree={rollout.ring_degree}: vllm-omni's ring attention ignores attention masks, so "
            "padded text tokens are attended to in the rollout but masked in the trainer; fix: ring_degree=1 and "
            f"ulysses_degree={rollout.sp_size}"
        )
    if rollout.ulysses_mode == "advanced_uaa":
        reasons.append(
            "rollout ulysses_mode=advanced_uaa pads uneven sequences/heads its own way (the trainer pads text to "
            "the SP degree with masked tokens); fix: ulysses_mode=strict with SP-aligned token counts"
        )
    backend = rollout_attention_backend.upper()
    if backend not in EXACT_BACKENDS:
        reasons.append(
            f"rollout attention backend {rollout_attention_backend!r} is not exact softmax attention (the trainer "
            "uses SDPA); fix: DIFFUSION_ATTENTION_BACKEND=TORCH_SDPA or FLASH_ATTN"
        )
    if _dtype_name(trainer_dtype) != _dtype_name(rollout_dtype):
        reasons.append(
            f"rollout dtype {rollout_dtype} != trainer compute dtype {trainer_dtype}: log-probs differ by rounding; "
            "fix: run both in the same precision (e.g. mixed_precision.param_dtype=bf16 in the trainer)"
        )
    if warn:
        for reason in reasons:
            warnings.warn(reason, RolloutMismatchWarning, stacklevel=2)
    return reasons


def _dtype_name(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}.get(
        str(name).lower().removeprefix("torch."), str(name).lower().removeprefix("torch.")
    )
