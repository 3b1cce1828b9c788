"""What an ``FSDPEngine`` is built from: one settings object that the trainer's config, verl's configs and
direct callers all translate into (nothing restates the engine's arguments)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..patching.backend_registration import BACKEND_NAME
from .compiling import COMPILE_MODES

__all__ = ["EngineSettings", "LoraSettings", "OptimSettings"]


@dataclass(frozen=True)
class OptimSettings:
    """AdamW with linear warmup; gradients clipped to ``max_grad_norm`` (<= 0: no clipping)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        # a NaN compares false with everything: NaN lr/eps poison every parameter, a NaN norm turns clipping off
        checks = [
            ("lr", self.lr, self.lr >= 0, "a finite number >= 0"),
            ("eps", self.eps, self.eps > 0, "a finite number > 0"),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0, "a finite number >= 0"),
            ("max_grad_norm", self.max_grad_norm, True, "a finite number (<= 0: no clipping)"),
            *((f"betas[{i}]", b, 0 <= b < 1, "in [0, 1)") for i, b in enumerate(self.betas)),
        ]
        for name, value, ok, rule in checks:
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ValueError(f"OptimSettings.{name}={value!r} is invalid: it must be {rule}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(
                f"OptimSettings.warmup_steps={self.warmup_steps!r} is invalid: it must be an int >= 0"
            )


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft) added before sharding; the base weights are frozen."""

    rank: int = 8
    alpha: float = 8.0
    target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    init: str | bool = "gaussian"  # peft's init_lora_weights
    adapter_name: str = "default"
    # the adapters' initial draw: seeded, so that every rank (replicas, shards) draws the same and runs repeat;
    # None: the global RNG, as peft draws
    seed: int | None = 0

    @contextlib.contextmanager
    def seeded(self) -> Iterator[None]:
        """The adapters' initialisation inside: the RNGs (CPU and every GPU) seeded by ``seed`` and restored after,
        so the caller's random stream is untouched."""
        if self.seed is None:
            yield
            return
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            yield


@dataclass(frozen=True)
class EngineSettings:
    """The engine's layout, optimizer, adapters and execution options.

    Args:
        ulysses_sequence_parallel_size: the Ulysses degree (verl's flag name); 1 turns SP off.
        ring_degree: the ring dimension of Ulysses x Ring (USP): SP degree = ulysses x ring, heads need only
            divide the Ulysses degree.
        dp_replicate: HSDP: FSDP shards parameters within each of ``dp_replicate`` replica groups of
            ``world / dp_replicate`` consecutive ranks (a node) and replicates them across the groups (gradients
            reduce-scattered within a group, all-reduced across); 1: sharded over every rank. It must divide
            dp = world / (ulysses x ring), so that an SP group lies within one replica group.
        optim: AdamW, warmup and clipping.
        lora: add LoRA adapters before sharding and train only them (None: full fine-tuning).
        use_fsdp: shard with FSDP2 (``fully_shard``); False keeps replicas and all-reduces gradients.
        mixed_precision: ``"bf16"`` computes in bfloat16 with fp32 gradient reduction (FSDP only).
        activation_checkpointing: recompute block activations in backward (``enable_gradient_checkpointing``).
        attention_backend: the diffusers attention backend (``ulysses_sdpa``, or ``native`` after install()).
        debug_checks: verify with a checksum that SP peers see the same batch, and raise on divergence.
        pad_text_to_degree: ``prepare_batch`` pads text to a multiple of the SP degree (else to the batch
            maximum only: any length shards exactly, and a model without a text mask, such as Wan, attends
            to padding, so padding only under SP would change its result).
        device: the compute device (None: ``cuda:LOCAL_RANK`` with a GPU, else the CPU).
        ema_decay: keep an exponential moving average of the trained parameters with this decay (flow_grpo: 0.9),
            updated by ``ema_step`` every ``ema_interval`` optimizer steps (``engine/ema.py``); None: none.
        frozen: a model that is not trained (Wan2.2's other expert): sharded like a trained one, its parameters
            stored in the compute dtype, no gradients, no optimizer (forward only).
        weights: where the values of a model built on ``meta`` come from, loaded after sharding so that no rank
            holds the whole model (``engine/weights.py``): a ``save_pretrained`` folder or ``.safetensors`` file
            (each rank reads only its shards), a state dict of full tensors, a callable ``init(model)``, or
            ``"empty"`` (left uninitialised: tracing under ``FakeTensorMode``, or a checkpoint load follows).
            None for a model whose parameters hold values already.
        compile: ``"off"``, ``"blocks"`` (torch.compile each block's forward, fullgraph) or ``"model"`` (the
            whole forward; fullgraph unless FSDP shards the blocks, whose hooks then split the graph); see
            ``engine/compiling.py``.
    """

    ulysses_sequence_parallel_size: int = 1
    ring_degree: int = 1
    dp_replicate: int = 1
    optim: OptimSettings = field(default_factory=OptimSettings)
    lora: LoraSettings | None = None
    use_fsdp: bool = True
    mixed_precision: str | None = None
    activation_checkpointing: bool = False
    attention_backend: str = BACKEND_NAME
    debug_checks: bool = False
    pad_text_to_degree: bool = False
    device: Any = None
    weights: Any = None
    frozen: bool = False
    ema_decay: float | None = None
    ema_interval: int = 8
    compile: str = "off"

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile={self.compile!r} is not one of {COMPILE_MODES}")
        if self.frozen and self.lora is not None:
            raise ValueError("EngineSettings(frozen=True, lora=...): a frozen model trains nothing; fix: lora=None")
        if self.mixed_precision not in (None, "bf16", "fp32"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: choose None/'fp32' or 'bf16'")
        if not self.use_fsdp and self.dp_replicate != 1:
            raise ValueError(
                f"dp_replicate={self.dp_replicate!r} asks for HSDP (FSDP sharding within replica groups), but "
                "use_fsdp=False keeps a whole replica on every rank; fix: use_fsdp=True, or dp_replicate=1"
            )

    def replace(self, **changes: Any) -> EngineSettings:
        """A copy with ``changes``; an unknown name is refused with the closest field names."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            close = {k: difflib.get_close_matches(k, names, n=2) for k in unknown}
            raise TypeError(f"unknown engine setting(s) {unknown} (closest: {close}); valid: {sorted(names)}")
        return dataclasses.replace(self, **changes)
