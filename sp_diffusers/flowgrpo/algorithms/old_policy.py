"""DiffusionNFT's old policy: a second copy of the trained model's weights, sharded like them, forward only.

The reference (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``) keeps a second LoRA adapter ``old``, copies the
trained one into it before the first epoch, samples every rollout with it and reads its velocity as ``v_old`` in
the loss; after each epoch ``old <- d old + (1 - d) theta`` with ``d`` from a schedule of the optimizer step
(``return_decay``). Here the old policy is an ``FSDPEngine(frozen=True)`` of the same class and config (LoRA
layers included, when the run trains them): built on ``meta``, sharded on the same mesh as the trained model, so
every rank's shard of a parameter covers the same rows on both, and filled shard by shard from the trained one.
Copying and decaying are local (no collective): each rank blends its own shards. The frozen copy stores its
parameters in the compute dtype (bf16 under ``parallel.mixed_precision=bf16``; the blend is computed in fp32
and rounded once).

The cost: one more shard of every parameter per rank (1 / world of the model, in the compute dtype), the base
weights included under LoRA, where the reference's second adapter costs only the adapter's size.
"""

from __future__ import annotations

from typing import Any

import torch

from ...engine import FSDPEngine
from ...engine.model_setup import add_lora
from ...engine.weights import meta_model

__all__ = ["DECAY_SCHEDULES", "OldPolicy", "old_policy_decay"]

# name: (flat, uprate, uphold) of the reference's return_decay (decay_type 0, 1, 2); names as verl-omni's
# algorithm.old_policy_decay_schedule
DECAY_SCHEDULES = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}


def old_policy_decay(step: int, schedule: str) -> float:
    """The decay ``d`` after optimizer step ``step``: 0 before ``flat``, then ``min((step - flat) uprate, uphold)``."""
    if schedule not in DECAY_SCHEDULES:
        raise ValueError(
            f"flowgrpo.nft.decay={schedule!r}: choose one of {', '.join(DECAY_SCHEDULES)} (DiffusionNFT's decay_type "
            "0, 1, 2)"
        )
    flat, uprate, uphold = DECAY_SCHEDULES[schedule]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (FSDP2's DTensor), or the tensor itself (a replica)."""
    return t.to_local() if hasattr(t, "to_local") else t


class OldPolicy:
    """The frozen twin of ``engine``'s model; ``copy()`` and ``blend(d)`` update it from the trained weights."""

    def __init__(self, engine: FSDPEngine) -> None:
        model = engine.model
        twin = meta_model(type(model), dict(model.config))
        if engine.lora is not None:  # the same adapter layers, so every parameter has its twin
            add_lora(twin, engine.lora)
        self.trained = engine
        # weights: filled from the trained shards once sharded (engine/weights.py calls it after to_empty)
        self.engine = FSDPEngine(twin, engine.settings.replace(frozen=True, lora=None, weights=self._fill))

    def _fill(self, twin: torch.nn.Module) -> None:
        self._blend(twin, 0.0)

    def _pairs(self, twin: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # looked up each time: FSDP2 may re-register a module's sharded parameters (lazy init after to_empty)
        ours = dict(twin.named_parameters())
        theirs = dict(self.trained.model.named_parameters())
        if set(ours) != set(theirs):
            odd = sorted(set(ours) ^ set(theirs))[:4]
            raise ValueError(
                f"the old policy's parameters differ from the trained model's ({odd}): "
                f"{type(self.trained.model).__name__} does not rebuild from its config; fix: another "
                "flowgrpo.algorithm for this model"
            )
        return [(ours[n], theirs[n]) for n in ours]

    def blend(self, decay: float) -> None:
        """``old <- decay old + (1 - decay) theta``, shard by shard (fp32, rounded once to the old policy's dtype)."""
        self.engine.release_params()  # only shards: a root left gathered by a forward would be written stale
        self._blend(self.engine.model, decay)

    @torch.no_grad()
    def _blend(self, twin: torch.nn.Module, decay: float) -> None:
        self.trained.release_params()
        for old, new in self._pairs(twin):
            o, n = _local(old), _local(new)
            if o.shape != n.shape:
                raise RuntimeError(
                    f"old policy shard {tuple(o.shape)} != trained shard {tuple(n.shape)}: the two models are sharded "
                    "differently; this is a bug (they are built on the same mesh)"
                )
            if decay == 0.0:
                o.copy_(n)
            else:
                o.copy_(o.float() * decay + n.float() * (1.0 - decay))

    def copy(self) -> None:
        """``old <- theta`` (decay 0)."""
        self.blend(0.0)

    def forward(self, **inputs: Any) -> torch.Tensor:
        return self.engine.forward(**inputs)
