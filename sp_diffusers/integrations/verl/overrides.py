"""verl-style hydra overrides -> the FlowGRPO ``TrainConfig`` (``sp-diffusers train KEY=VALUE ...``).

A verl user's flag works unchanged::

    sp-diffusers train actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2 \
        actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.model.path=/ckpt/transformer \
        actor_rollout_ref.actor.optim.lr=1e-4 trainer.n_gpus_per_node=2 trainer.nnodes=1

``VERL_KEYS`` lists every verl key understood and the ``TrainConfig`` key it sets; keys of our own sections
(``flowgrpo.group_size=8``) pass through. A verl key without a counterpart is refused with the closest
supported keys (nothing is silently ignored). ``trainer.n_gpus_per_node x trainer.nnodes`` is the world
size the launcher must start (checked against torchrun's ``WORLD_SIZE``), and
``actor_rollout_ref.rollout.engine_kwargs.vllm_omni.*`` are validated as the rollout's SP settings.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from ...flowgrpo.config import ConfigError, TrainConfig
from ..vllm_omni import (
    ENGINE_KWARGS_PREFIX,
    RolloutConfigError,
    RolloutParallelSettings,
    check_consistency,
    settings_from_engine_kwargs,
)
from .config import BACKENDS as STRATEGIES
from .config import FSDP_SIZE_KEY, RING_KEY, SP_KEY, dp_replicate_of

REF_SP_KEY = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"
STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
VERL_ROOTS = (
    "actor_rollout_ref",
    "trainer",
    "data",
    "algorithm",
    "critic",
    "reward_model",
    "custom_reward_function",
    "ray_init",
)

# verl key -> TrainConfig key (plain copies of the value)
VERL_KEYS: dict[str, str] = {
    SP_KEY: "parallel.ulysses_sequence_parallel_size",
    "actor_rollout_ref.model.path": "model.pretrained",
    RING_KEY: "parallel.ring_degree",
    "actor_rollout_ref.model.lora_alpha": "lora.alpha",
    "actor_rollout_ref.model.target_modules": "lora.target_modules",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "parallel.activation_checkpointing",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "optim.weight_decay",
    "actor_rollout_ref.actor.optim.clip_grad": "optim.max_grad_norm",
    "actor_rollout_ref.actor.grad_clip": "optim.max_grad_norm",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "optim.warmup_steps",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "flowgrpo.micro_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "flowgrpo.inner_epochs",
    "actor_rollout_ref.actor.clip_ratio": "flowgrpo.clip_range",
    "actor_rollout_ref.actor.kl_loss_coef": "flowgrpo.kl_coef",
    "actor_rollout_ref.rollout.n": "flowgrpo.group_size",
    "trainer.total_training_steps": "train.iterations",
    "trainer.default_local_dir": "train.out_dir",
    "trainer.save_freq": "train.save_every",
}
# verl keys handled by a rule rather than a copy
SPECIAL_KEYS = (
    STRATEGY_KEY,
    REF_SP_KEY,
    FSDP_SIZE_KEY,
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
)

__all__ = ["SPECIAL_KEYS", "VERL_KEYS", "VerlPlan", "is_verl_key", "translate_overrides"]


@dataclass
class VerlPlan:
    """What a list of overrides means: our config overrides, the launch size and the rollout settings."""

    overrides: list[str] = field(default_factory=list)  # TrainConfig "key=value" overrides, in order
    verl: dict[str, Any] = field(default_factory=dict)  # the verl keys given, parsed
    n_gpus_per_node: int | None = None
    nnodes: int | None = None
    rollout: RolloutParallelSettings | None = None

    @property
    def world_size(self) -> int | None:
        """``n_gpus_per_node x nnodes`` when either is given (the other defaults to 1)."""
        if self.n_gpus_per_node is None and self.nnodes is None:
            return None
        return (self.n_gpus_per_node or 1) * (self.nnodes or 1)

    def check_launch(self, world_size: int) -> None:
        """Refuse a launch whose process count is not ``trainer.n_gpus_per_node x trainer.nnodes``."""
        if self.world_size is not None and self.world_size != world_size:
            raise ConfigError(
                f"trainer.n_gpus_per_node x trainer.nnodes = {self.n_gpus_per_node or 1} x {self.nnodes or 1} = "
                f"{self.world_size} but {world_size} processes were launched; fix: launch {self.world_size} "
                f"(torchrun --nnodes {self.nnodes or 1} --nproc_per_node {self.n_gpus_per_node or 1}) or change "
                "the two keys"
            )

    def check_rollout(self, config: TrainConfig) -> list[str]:
        """Warn where the rollout's attention (engine_kwargs.vllm_omni.*) would differ from the trainer's."""
        if self.rollout is None:
            return []
        return check_consistency(
            self.rollout,
            trainer_dtype=config.parallel.mixed_precision or "fp32",
            rollout_dtype=str(self.verl.get("actor_rollout_ref.rollout.dtype", "bf16")),
        )


def is_verl_key(key: str) -> bool:
    return key.split(".", 1)[0] in VERL_ROOTS


def _parse(raw: str) -> Any:
    import yaml

    return yaml.safe_load(raw)


def _section_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig)}


def translate_overrides(items: list[str]) -> VerlPlan:
    """``["verl.key=value" | "our.key=value", ...]`` -> a ``VerlPlan`` (errors name the key and the fix)."""
    plan = VerlPlan()
    engine_kwargs: dict[str, Any] = {}
    ours = _section_keys()
    supported = sorted([*VERL_KEYS, *SPECIAL_KEYS, f"{ENGINE_KWARGS_PREFIX}.<field>"])
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. {SP_KEY}=2)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")  # hydra's "+key" / "++key" (add / force-add) mean the same here
        if key.startswith("~"):
            raise ConfigError(
                f"override {item!r} deletes a key; fix: sp-diffusers has no key deletion, omit it"
            )
        if key.split(".", 1)[0] in ours:
            plan.overrides.append(f"{key}={raw}")
            continue
        if not is_verl_key(key):
            close = difflib.get_close_matches(key, [*supported, *ours], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"unknown override key '{key}'{hint} (verl keys start with {', '.join(VERL_ROOTS[:2])}, ...; "
                f"ours with {', '.join(sorted(ours))})"
            )
        value = _parse(raw)
        plan.verl[key] = value
        if key.startswith(ENGINE_KWARGS_PREFIX + "."):
            engine_kwargs[key[len(ENGINE_KWARGS_PREFIX) + 1 :]] = value
        elif key in VERL_KEYS:
            plan.overrides.append(f"{VERL_KEYS[key]}={raw}")
        elif key in SPECIAL_KEYS:
            _special(plan, key, value)
        elif key == "actor_rollout_ref.rollout.dtype":
            pass  # read by check_rollout
        else:
            close = difflib.get_close_matches(key, supported, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"verl key '{key}' has no counterpart in sp-diffusers' FlowGRPO trainer{hint}; fix: drop it, or use "
                f"one of the supported keys (docs/integrations.md lists them)"
            )
    _finish(plan, engine_kwargs)
    return plan


def _special(plan: VerlPlan, key: str, value: Any) -> None:
    if key == STRATEGY_KEY:
        if value not in STRATEGIES:
            raise ConfigError(
                f"{key}={value!r} is not supported by sp-diffusers (an FSDP2 engine); fix: {key}=fsdp2 (or fsdp)"
            )
        plan.overrides.append("parallel.use_fsdp=true")
    elif key in (REF_SP_KEY, FSDP_SIZE_KEY):
        pass  # checked against the actor's degree / mapped with the world in _finish
    elif key == "actor_rollout_ref.model.lora_rank":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{key}={value!r} must be an int >= 0 (0: full fine-tuning); fix: {key}=16")
        plan.overrides.append(f"lora.enabled={'true' if value > 0 else 'false'}")
        if value > 0:
            plan.overrides.append(f"lora.rank={value}")
    elif key == "actor_rollout_ref.actor.use_kl_loss":
        if value is False:
            plan.overrides.append("flowgrpo.kl_coef=0.0")
    elif key == "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype":
        name = str(value).lower()
        if name not in ("bf16", "bfloat16", "fp32", "float32"):
            raise ConfigError(
                f"{key}={value!r}: sp-diffusers trains in fp32 or bf16; fix: {key}=bf16 (or fp32)"
            )
        plan.overrides.append(f"parallel.mixed_precision={'bf16' if name in ('bf16', 'bfloat16') else ''!r}")
    elif key in ("trainer.n_gpus_per_node", "trainer.nnodes"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key}={value!r} must be a positive int; fix: {key}=1")
        setattr(plan, key.split(".", 1)[1], value)


def _finish(plan: VerlPlan, engine_kwargs: dict[str, Any]) -> None:
    actor_sp = plan.verl.get(SP_KEY)
    ref_sp = plan.verl.get(REF_SP_KEY)
    if ref_sp is not None and ref_sp != (actor_sp if actor_sp is not None else ref_sp):
        raise ConfigError(
            f"{REF_SP_KEY}={ref_sp!r} differs from {SP_KEY}={actor_sp!r}: the KL reference is the same model with "
            "LoRA adapters off, so it runs in the actor's layout; fix: give both the same degree"
        )
    if ref_sp is not None and actor_sp is None:
        plan.overrides.append(f"parallel.ulysses_sequence_parallel_size={ref_sp}")
    sp = actor_sp if actor_sp is not None else ref_sp
    if sp is not None and (not isinstance(sp, int) or isinstance(sp, bool) or sp < 1):
        raise ConfigError(f"{SP_KEY}={sp!r} must be a positive int; fix: {SP_KEY}=2")
    world = plan.world_size
    if sp is not None and world is not None and world % sp:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"{SP_KEY}={sp} does not divide trainer.n_gpus_per_node x trainer.nnodes = {world}; fix: pick one of "
            f"{divisors}"
        )
    _map_fsdp_size(plan, sp)
    if engine_kwargs:
        try:
            plan.rollout = settings_from_engine_kwargs(engine_kwargs)
        except RolloutConfigError as err:
            raise ConfigError(str(err)) from err


def _map_fsdp_size(plan: VerlPlan, ulysses: Any) -> None:
    """verl's shard group size -> ``parallel.dp_replicate = world / fsdp_size`` (needs the world, from
    ``trainer.n_gpus_per_node x trainer.nnodes``); refused where it disagrees with a ``parallel.dp_replicate`` given
    alongside."""
    fsdp_size = plan.verl.get(FSDP_SIZE_KEY)
    if fsdp_size is None:
        return
    world = plan.world_size
    if isinstance(fsdp_size, int) and not isinstance(fsdp_size, bool) and fsdp_size < 0:
        replicate = 1
    elif world is None:
        raise ConfigError(
            f"{FSDP_SIZE_KEY}={fsdp_size!r} is verl's FSDP shard group, so HSDP's replica groups are world / "
            f"fsdp_size, and the world is not given; fix: also give trainer.n_gpus_per_node (and trainer.nnodes), "
            "or set parallel.dp_replicate=<world / fsdp_size> instead"
        )
    else:
        ring = plan.verl.get(RING_KEY, 1)
        sp = (ulysses if isinstance(ulysses, int) else 1) * (ring if isinstance(ring, int) else 1)
        try:
            replicate = dp_replicate_of(fsdp_size, world, sp)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    for item in plan.overrides:
        key, _, raw = item.partition("=")
        if key == "parallel.dp_replicate" and _parse(raw) != replicate:
            raise ConfigError(
                f"parallel.dp_replicate={raw} disagrees with {FSDP_SIZE_KEY}={fsdp_size}, which means "
                f"dp_replicate={replicate}{f' on a world of {world} ranks' if world else ''}; fix: give one of "
                "the two keys"
            )
    plan.overrides.append(f"parallel.dp_replicate={replicate}")
