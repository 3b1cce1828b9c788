"""Which layouts a plan traces: every Ulysses degree that divides the GPUs and the heads, every ring degree that
divides what is left, HSDP's replica count where the GPUs span nodes, activation checkpointing on and off; fixed
degrees validated here, once, with the valid ones named.
"""

from __future__ import annotations

import math
from typing import Any

from .models import ModelSpec, PlanError

PlanRequest = Any  # planner.PlanRequest (the planner imports this module, not the other way round)

__all__ = ["checkpointing", "layouts", "replicates"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _heads(spec: ModelSpec) -> int:
    """The heads a Ulysses degree must divide: every attention's (LTX-2: its audio stream's too)."""
    heads = int(spec.config.get("num_attention_heads", spec.config.get("n_heads", 1)))  # Z-Image: n_heads
    audio = spec.config.get("audio_num_attention_heads")
    return math.gcd(heads, int(audio)) if audio else heads


def layouts(req: PlanRequest) -> list[tuple[int, int]]:
    """Every (ulysses, ring) to plan; bad fixed degrees are refused with the valid ones."""
    gpus, heads = req.gpus, _heads(req.spec)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r} is invalid: it must be a positive integer")
    ok_u = [u for u in _divisors(gpus) if heads % u == 0]
    for name, value in (("--ulysses", req.ulysses), ("--ring", req.ring)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"{name} {value!r} is invalid: it must be a positive integer")
    if req.ulysses is not None and req.ulysses not in ok_u:
        why = []
        if gpus % req.ulysses:
            why.append(f"does not divide --gpus {gpus}")
        if heads % req.ulysses:
            why.append(f"does not divide the {heads} attention heads of {req.spec.name}")
        raise PlanError(f"--ulysses {req.ulysses} {' and '.join(why)}; fix: one of {ok_u}")
    us = [req.ulysses] if req.ulysses is not None else ok_u
    pairs = []
    for u in us:
        rings = _divisors(gpus // u)
        if req.ring is not None:
            if req.ring not in rings:
                raise PlanError(
                    f"--ring {req.ring} with --ulysses {u}: ulysses x ring = {u * req.ring} does not divide "
                    f"--gpus {gpus}; fix: a ring degree among {rings}"
                )
            rings = [req.ring]
        pairs += [(u, r) for r in rings]
    return _audio_fits(req, pairs)


def _audio_fits(req: PlanRequest, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """LTX-2: sequence parallelism splits the audio stream too, which needs at least one audio token per rank of
    ulysses x ring (the trainer refuses fewer, as for any split input); the layouts with more ranks are dropped,
    refused when they were asked for."""
    audio = getattr(req.work, "audio_tokens", 0)
    if not audio:
        return pairs
    kept = [(u, r) for u, r in pairs if u * r <= audio]
    if not kept:
        u, r = min(pairs, key=lambda p: p[0] * p[1])
        raise PlanError(
            f"ulysses x ring = {u * r} exceeds the {audio} audio tokens of {req.spec.name}'s micro-batch (sequence "
            "parallelism splits the audio stream, at least one token per rank); fix: a longer video (--frames, or "
            f"--tokens: 25 audio tokens a second at 24 fps), or --ulysses / --ring with a product of at most {audio}"
        )
    return kept


def checkpointing(req: PlanRequest) -> list[bool]:
    choices = {"on": [True], "off": [False], "auto": [False, True]}
    if req.checkpointing not in choices:
        raise PlanError(f"--activation-checkpointing {req.checkpointing!r}: choose on, off or auto")
    return choices[req.checkpointing]




def replicates(req: PlanRequest, ulysses: int, ring: int) -> list[int]:
    """HSDP's replica counts to plan at ``ulysses x ring`` (``parallel.dp_replicate``): ``--replicate`` (it must
    divide the data-parallel degree), else 1 (FSDP over every GPU) and, on more than one node, one replica per node
    (each node shards the parameters within itself) where the nodes divide the data-parallel degree."""
    dp = req.gpus // (ulysses * ring)
    if req.replicate is not None:
        if isinstance(req.replicate, bool) or not isinstance(req.replicate, int) or req.replicate < 1:
            raise PlanError(f"--replicate {req.replicate!r} is invalid: it must be a positive integer")
        if dp % req.replicate:
            raise PlanError(
                f"--replicate {req.replicate} does not divide the data-parallel degree {dp} of ulysses {ulysses} x "
                f"ring {ring} on {req.gpus} GPUs; fix: one of {_divisors(dp)} (or fix --ulysses / --ring)"
            )
        return [req.replicate]
    return [1] + ([req.nodes] if req.nodes > 1 and dp % req.nodes == 0 else [])
