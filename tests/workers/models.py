"""Model level: every tiny model of ``model_cases`` under Ulysses (and Ulysses x Ring) vs one process, output
and every parameter gradient.

Runs inside spawned ranks, possibly against another diffusers version (the matrix) than the parent. A case is
(model, length, backend). The same seed builds the same model and inputs on every rank. The single-process
reference of (model, length) is computed once, by one rank (the case's *owner*: ranks share the references
out), and stored under ``ref_dir`` so that later runs of the same diffusers version (other degrees, the other
backend) load it instead. The SP model runs with ``enable_parallelism`` on the given backend; the loss
``sum_i mean(out_i * g_i)`` uses fixed random ``g_i`` over the full (gathered) outputs, so each rank's
gradients are partial and their SUM over the SP group is the full gradient (the gradient contract). All
gradients travel in one flattened reduce to the owner, which compares.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .common import flat_grads
from .model_cases import build, outputs, sp_inputs

RTOL = 1e-4


def _quiet() -> None:
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)


def _loss(outs: list[torch.Tensor], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 2)
    return sum((o * torch.randn(o.shape, generator=g)).mean() for o in outs)


def _reference(name: str, length: str, seed: int, ref_dir: str) -> dict[str, Any]:
    """One process: outputs, flattened gradients and the parameters' sizes (loaded if already stored)."""
    path = Path(ref_dir) / f"{name}-{length}.pt"
    if path.exists():
        return torch.load(path)
    model, inputs = build(name, length, seed)
    outs = outputs(model(**inputs, return_dict=False))
    _loss(outs, seed).backward()
    ref = {
        "outs": [o.detach() for o in outs],
        "grads": flat_grads(model),
        "sizes": [p.numel() for p in model.parameters()],
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ref, tmp)
    tmp.replace(path)  # whole files only: a later run never reads half a reference
    return ref


def _compare(outs: list[torch.Tensor], local: torch.Tensor, summed: torch.Tensor, ref: dict) -> dict:
    """allclose criterion |a - b| <= atol + rtol * |b|, reported as the worst excess over rtol * |b|."""
    if [o.shape for o in outs] != [o.shape for o in ref["outs"]]:
        return {
            "error": f"output shapes {[tuple(o.shape) for o in outs]}, reference {[tuple(o.shape) for o in ref['outs']]}"
        }
    out_err = max(
        (o - r).abs().sub(RTOL * r.abs()).max().item() for o, r in zip(outs, ref["outs"], strict=True)
    )
    out_abs = max((o - r).abs().max().item() for o, r in zip(outs, ref["outs"], strict=True))
    g_ref = ref["grads"]
    diff = summed - g_ref
    per_param = list(
        zip(diff.split(ref["sizes"]), g_ref.split(ref["sizes"]), local.split(ref["sizes"]), strict=True)
    )
    nonzero = [(d, r, lo) for d, r, lo in per_param if r.abs().max() > 0]
    return {
        "out_err": out_err,
        "out_abs": out_abs,
        "out_scale": max(r.abs().max().item() for r in ref["outs"]),
        "grad_err": diff.abs().sub(RTOL * g_ref.abs()).max().item(),
        "grad_abs": diff.abs().max().item(),
        "grad_rel": max((d.norm() / r.norm()).item() for d, r, _ in nonzero),
        # without the SUM each rank's gradient is only its share: the contract must be visible
        "local_only_rel": max(((lo - r).norm() / r.norm()).item() for _, r, lo in nonzero),
        "n_params": len(per_param),
        "n_params_with_grad": len(nonzero),
    }


def _sp_case(
    name: str,
    length: str,
    backend: str,
    return_dict: bool,
    owner: int,
    ref: dict | None,
    config: Any,
    seed: int,
) -> dict:
    world = dist.get_world_size()
    model, inputs = build(name, length, seed)
    model.set_attention_backend(backend)
    model.enable_parallelism(config=config())
    result = model(**sp_inputs(name, length, inputs, world), return_dict=return_dict)
    if return_dict and not hasattr(result, "to_tuple"):
        raise TypeError(f"return_dict=True gave {type(result).__name__}, not an output dataclass")
    outs = outputs(result)
    _loss(outs, seed).backward()
    local = flat_grads(model)
    summed = local.clone()
    dist.reduce(summed, dst=owner)  # every gradient in one collective
    if dist.get_rank() != owner:
        return {}
    return _compare([o.detach() for o in outs], local, summed, ref)


def model_parity(
    rank: int,
    world: int,
    names: list[str],
    lengths: list[str],
    backends: list[str],
    ref_dir: str,
    ring: int = 1,
    return_dict_backend: str | None = "native",
) -> dict:
    """Every (name, length, backend); ``return_dict=True`` in the even case of ``return_dict_backend``."""
    import diffusers

    import sp_diffusers

    _quiet()
    report = sp_diffusers.install()
    seed = 0
    cases = [(n, ln) for n in names for ln in lengths]
    owners = {case: i % world for i, case in enumerate(cases)}
    refs: dict[tuple[str, str], Any] = {}
    results: dict[str, dict] = {}
    # first every rank computes (or loads) the references it owns: no collective, the ranks run side by side
    for case, owner in owners.items():
        if owner == rank:
            try:
                refs[case] = _reference(*case, seed, ref_dir)
            except Exception as err:  # reported for each backend of the case; the parent asserts
                refs[case] = f"reference: {type(err).__name__}: {err}"
    # every rank must skip a case whose reference failed (its owner would not join the collectives)
    failed: list[dict] = [None] * world
    dist.all_gather_object(failed, {c: r for c, r in refs.items() if isinstance(r, str)})
    failed_refs = {c: r for part in failed for c, r in part.items()}
    mesh = sp_diffusers.build_device_mesh(ulysses_degree=world // ring, ring_degree=ring)

    def config() -> Any:
        return sp_diffusers.context_parallel_config(ulysses_degree=world // ring, ring_degree=ring, mesh=mesh)

    for (name, length), owner in owners.items():
        for backend in backends:
            key = f"{name}/{length}/{backend}"
            return_dict = backend == return_dict_backend and length == "even"
            ref = refs.get((name, length))
            try:
                if (name, length) in failed_refs:
                    raise RuntimeError(failed_refs[(name, length)])
                r = _sp_case(name, length, backend, return_dict, owner, ref, config, seed)
            except Exception as err:  # reported per case; the parent asserts
                r = {"error": f"{type(err).__name__}: {err}"}
            if rank == owner:
                results[key] = {**r, "return_dict": return_dict}
            dist.barrier()
    return {"diffusers": diffusers.__version__, "applied": list(report.applied), "results": results}
