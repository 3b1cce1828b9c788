"""The plan patches (diffusers plans that are wrong for training, and the hook defect their fixes need):
does the defect show without the patch, and does the model match one process with it?

Runs inside ``patch_checks`` (gloo ranks, one diffusers version of the matrix). Each check reverts one patch,
builds the tiny model (``enable_parallelism`` reads the class's plan when it is called), runs forward and
backward against a single-process copy, re-applies the patch and repeats. Lengths divide the degree, so
every rank fails (or not) at the same place and no collective is left waiting.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .common import summed_grads

ATOL, RTOL = 1e-5, 1e-4


def _try(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as err:  # the caller records what happened
        return None, f"{type(err).__name__}: {err}"


def _tensors(result: Any) -> list[torch.Tensor]:
    if torch.is_tensor(result):
        return [result]
    return [t for item in result for t in _tensors(item)]


def _excess(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst excess of |a - b| over the parity tolerance (<= 0: within it)."""
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().sub(ATOL + RTOL * b.abs()).max().item() + ATOL


def _parity(
    kind: str, world: int, inputs_kw: dict, overrides: dict | None = None, edit: Callable | None = None
) -> float:
    """max excess over the tolerance of every output and every summed parameter gradient, SP vs one process."""
    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    model = tiny_model(kind, seed=0, **(overrides or {}))
    reference = copy.deepcopy(model)
    inputs = tiny_inputs(kind, model, batch=2, seed=1, **inputs_kw)
    if edit is not None:
        inputs = edit(model, inputs)
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world))
    outs = _tensors(model(**inputs, return_dict=False))
    refs = _tensors(reference(**inputs, return_dict=False))
    if len(outs) != len(refs):
        return float("inf")
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(r.shape, generator=g) for r in refs]
    sum((o * w).mean() for o, w in zip(outs, weights, strict=True)).backward()
    sum((r * w).mean() for r, w in zip(refs, weights, strict=True)).backward()
    worst = max(_excess(o.detach(), r.detach()) for o, r in zip(outs, refs, strict=True))
    for grad, p_ref in zip(summed_grads(model), reference.parameters(), strict=True):
        worst = max(worst, _excess(grad, p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)))
    return worst


def _check(patch, run: Callable[[], float]) -> dict:
    """``run`` without the patch (an error or a mismatch is the defect), then with it (must match)."""
    was_applied = patch.is_applied()
    patch.revert()
    err, failure = _try(run)
    defect = failure or (f"differs from one process (excess {err:.2e})" if err > ATOL else None)
    dist.barrier()
    if was_applied:
        patch.apply()
    err, failure = _try(run)
    return {"defect": defect, "fixed": failure is None and err <= ATOL, "fixed_error": failure, "excess": err}


def check_plan_optional_inputs(world: int) -> dict:
    """A call without the optional text masks its plan names: LTX-2 (with the ``ltx2_plan`` fix, 0.37+), or
    Qwen-Image at 0.36, whose plan splits ``encoder_hidden_states_mask`` at the root."""
    import diffusers

    from sp_diffusers.patching.patches import plan_optional_inputs as patch

    if getattr(diffusers, "LTX2VideoTransformer3DModel", None) is None:
        kind, kw, drop = "qwenimage", dict(image_hw=(8, 8), text_len=8), ("encoder_hidden_states_mask",)
    else:
        kind, kw = "ltx2", dict(image_hw=(4, 4), frames=1, text_len=8, audio_len=8)
        drop = ("encoder_attention_mask", "audio_encoder_attention_mask")

    def edit(model, inputs):
        return {k: v for k, v in inputs.items() if k not in drop}

    return _check(patch, lambda: _parity(kind, world, {**kw, "ragged_text": False}, edit=edit))


def check_per_token_timestep(world: int) -> dict:
    """LTX-Video with a timestep per video token ([B, N], the image-to-video pipelines)."""
    from sp_diffusers.patching.patches import per_token_timestep as patch

    kw = dict(image_hw=(4, 4), frames=1, text_len=8, per_token_timestep=True)
    return _check(patch, lambda: _parity("ltx", world, kw))


def check_wan_text_split(world: int) -> dict:
    """Wan-2.1-I2V-shaped (CLIP image tokens before 512 text tokens): 0.36's plan splits that context."""
    from sp_diffusers.patching.patches import wan_text_split as patch

    def edit(model, inputs):
        g = torch.Generator().manual_seed(3)
        image = torch.randn(2, 4, model.config.image_dim, generator=g)
        return {**inputs, "encoder_hidden_states_image": image}

    overrides = dict(image_dim=16, added_kv_proj_dim=64)
    kw = dict(image_hw=(4, 4), frames=1, text_len=512)
    return _check(patch, lambda: _parity("wan", world, kw, overrides, edit))


def check_ltx2_plan(world: int) -> dict:
    """LTX-2, both streams: the shipped plan fails at the a2v attention (and replicates the audio stream)."""
    from sp_diffusers.patching.patches import ltx2_plan, plan_optional_inputs

    kw = dict(image_hw=(4, 4), frames=1, text_len=8, audio_len=8)
    # the fixed plan names inputs a call may leave out: its own fix needs plan_optional_inputs
    optional_applied = plan_optional_inputs.is_applied()
    plan_optional_inputs.apply()
    try:
        return _check(ltx2_plan, lambda: _parity("ltx2", world, kw))
    finally:
        if not optional_applied:
            plan_optional_inputs.revert()


def check_helios_plan(world: int) -> dict:
    """Helios with 40 blocks (the shipped plan names blocks 0-39): its gradients are not the single-process
    ones (0.38+), or it fails outright (0.37.1, ``guidance_cross_attn``)."""
    from sp_diffusers.patching.patches import helios_plan as patch

    kw = dict(image_hw=(8, 8), frames=1, text_len=8, history=False)
    return _check(patch, lambda: _parity("helios", world, kw, dict(num_layers=40)))


CHECKS = {
    "plan_optional_inputs": check_plan_optional_inputs,
    "per_token_timestep": check_per_token_timestep,
    "wan_text_split": check_wan_text_split,
    "ltx2_plan": check_ltx2_plan,
    "helios_plan": check_helios_plan,
}


def plan_checks(world: int) -> dict[str, dict]:
    """Every check whose model class the installed diffusers has."""
    import diffusers

    needs = {"ltx2_plan": "LTX2VideoTransformer3DModel", "helios_plan": "HeliosTransformer3DModel"}
    out = {}
    for name, check in CHECKS.items():
        if getattr(diffusers, needs.get(name, "ModelMixin"), None) is None:
            out[name] = {"defect": None, "fixed": True, "skipped": "class not in this diffusers"}
            continue
        out[name] = check(world)
        dist.barrier()
    return out
