"""One iteration's batch, typed: its prompts and their conditioning, the initial noise, the prompt groups, the seeds,
and the algorithm's choices for it (:class:`StepPlan`).

A batch is made on the host (ragged text, CPU tensors) from the iteration's generators, the same on the ranks of an
SP group (every draw is seeded by the iteration and the data-parallel rank); :meth:`IterationBatch.prepared` makes
it dense (the text padded to the SP degree), puts it on the device and broadcasts its tensors from the SP group's
first rank, through ``FSDPEngine.prepare_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..parallel.devices import to_device

__all__ = ["IterationBatch", "StepPlan", "agreed_count_groups"]


@dataclass
class StepPlan:
    """The algorithm's choices for one iteration (``Algorithm.plan``), drawn on the host.

    ``window_start`` / ``window_size``: the span of stochastic steps shared by every sample (``window_size`` None:
    ``flowgrpo.window_size``; MixGRPO's window moves and may shrink); ``window_starts``: one start per sample
    instead; ``train_steps [B, T]``: the schedule steps each sample trains (None: the span's), ``host_steps`` the same
    on the host where every sample shares them (two experts route by them); ``noise_seed``: DiffusionNFT's
    forward-process noise; ``in_group``: MixGRPO's count of iterations in its window's place (a metric)."""

    window_start: int = 0
    window_size: int | None = None
    window_starts: list[int] | None = None
    train_steps: torch.Tensor | None = None
    host_steps: list[int] | None = None
    noise_seed: int | None = None
    in_group: int = 0


@dataclass
class IterationBatch:
    """``prompts`` and ``metadata`` (each row's own fields) per sample, ``cond``: what the transformer is conditioned
    on, by the adapter's keyword (``prompt_embeds`` and its mask, the empty prompt's ``negative_*`` for CFG, pooled
    embeddings, an image condition's ``condition_*``), ``group_ids [B]`` (the prompt each sample belongs to, unique
    across data-parallel ranks), ``latents`` (the initial noise), ``sde_seed`` (the rollout's SDE noise),
    ``shuffle_seed`` (the update's shuffle), ``source_pixels`` (an image-conditioned family's source images, which
    rewards read) and, once the rewards are in, ``kept`` (the samples the update trains: the zero-advantage
    filter's choice; None: all) and ``kl_rows`` (``[B]`` bool, the samples a gated KL applies to: GARDO)."""

    prompts: list[str]
    cond: dict[str, Any]
    group_ids: torch.Tensor
    latents: torch.Tensor
    plan: StepPlan = field(default_factory=StepPlan)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    sde_seed: int = 0
    shuffle_seed: int = 0
    source_pixels: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    kl_rows: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def cond_of(self, index: torch.Tensor | slice | None = None) -> dict[str, Any]:
        """The conditioning of samples ``index`` (all: ``cond`` itself): a slice, or host indices (a CPU tensor, as
        the update's micro-batches are), which reach each tensor's device once (queued, no host sync); a host list
        (Z-Image's ``*_lengths``, a multi-image edit's ``condition_counts``) is indexed on the host; a tuple is the
        whole batch's (``condition_groups``: every rank's counts) and kept as it is."""
        if index is None:
            return dict(self.cond)
        if isinstance(index, slice):
            return {k: v if isinstance(v, tuple) else v[index] for k, v in self.cond.items()}
        lists = [k for k, v in self.cond.items() if isinstance(v, list)]
        if lists and index.device.type != "cpu":
            raise ValueError(
                f"IterationBatch.cond_of: the host lists {lists} are indexed on the host, and these indices are on "
                f"{index.device} (reading them would wait for the device); fix: pass the host indices (the micro-batch)"
            )
        host = index.tolist() if lists else []
        placed: dict[torch.device, torch.Tensor] = {}
        out: dict[str, Any] = {}
        for key, value in self.cond.items():
            if isinstance(value, tuple):
                out[key] = value
            elif isinstance(value, list):
                out[key] = [value[i] for i in host]
            else:
                if value.device not in placed:
                    placed[value.device] = to_device(index, value.device)
                out[key] = value[placed[value.device]]
        return out

    def prepared(self, engine: Any) -> IterationBatch:
        """Dense text (padded to the SP degree), on the engine's device, identical on every rank of the SP group
        (``FSDPEngine.prepare_batch``: broadcast from its first rank)."""
        tensors: dict[str, Any] = {**self.cond, "latents": self.latents, "group_ids": self.group_ids}
        if self.source_pixels is not None:
            tensors["source_pixels"] = self.source_pixels
        if self.plan.train_steps is not None:
            tensors["train_steps"] = self.plan.train_steps
        out = agreed_count_groups(engine.prepare_batch(tensors), engine)
        plan = replace(self.plan, train_steps=out.pop("train_steps", None))
        return replace(
            self,
            latents=out.pop("latents"),
            group_ids=out.pop("group_ids"),
            source_pixels=out.pop("source_pixels", None),
            plan=plan,
            cond=out,
        )


def agreed_count_groups(cond: dict[str, Any], engine: Any) -> dict[str, Any]:
    """``cond`` with ``condition_groups``: the sorted condition-image counts of the rows of every rank's batch (one
    host all-gather over the engine's control group: gloo, no device sync), where ``cond`` carries
    ``condition_counts``. ``sampling/denoise.velocity`` runs one forward per count of these groups on every rank (a
    stand-in row where a rank's batch has none of that count): FSDP gathers the parameters over every rank in each
    forward, so every rank must run as many as its peers, in the same order."""
    counts = cond.get("condition_counts")
    if counts is None:
        return cond
    mine = sorted(set(counts))
    group = engine.control_group  # an FSDPEngine's (editing families train one transformer)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        mine = sorted({c for part in every for c in part})
    return {**cond, "condition_groups": tuple(mine)}
