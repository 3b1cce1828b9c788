"""Model level: tiny Flux, Wan, Qwen-Image, SD3, HunyuanVideo (T2V and token-replace I2V) and CogVideoX
under Ulysses vs one process, every parameter gradient.

Runs inside spawned ranks, possibly against another diffusers version (the matrix) than the parent.
For each (model, backend, return_dict): the same seed builds the same model and inputs on every rank;
a deep copy without parallelism is the single-process reference; the SP model runs with
``enable_parallelism`` on the given backend. The loss ``sum(out * g)`` uses a fixed random ``g`` over
the full (gathered) output (``mean`` keeps gradients O(1)), so each rank's gradients are partial and their SUM over the SP group is the
full gradient (the gradient contract).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist

RTOL = 1e-4


def _quiet() -> None:
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)


# SD3 and CogVideoX run with an odd text length (unpadded in the reference, with diffusers' own processor) and
# are padded to the SP degree with a key mask under SP: padding + masking must give exactly the unpadded result.
# HunyuanVideo takes a text mask of its own: ragged in the reference, padded along with the text under SP.
TEXT = {
    "sd3": {"text_len": 9, "ragged_text": False},
    "hunyuanvideo": {"text_len": 9, "ragged_text": True},
    "cogvideox": {"text_len": 9, "ragged_text": False, "frames": 4},
    # 3 latent frames: at P = 4 the first frame's 16 tokens end inside rank 1's 12-token shard
    "hunyuanvideo_i2v": {"text_len": 9, "ragged_text": True, "frames": 3},
}
# Variants of a tiny model: case name -> (tiny kind, config overrides)
VARIANTS = {"hunyuanvideo_i2v": ("hunyuanvideo", {"image_condition_type": "token_replace"})}


def _sp_inputs(kind: str, inputs: dict, world: int) -> dict:
    kind = VARIANTS.get(kind, (kind,))[0]
    if kind not in ("sd3", "hunyuanvideo", "cogvideox"):
        return inputs
    from sp_diffusers.padding import pad_text_batch

    embeds, mask = pad_text_batch(
        inputs["encoder_hidden_states"], inputs.get("encoder_attention_mask"), world
    )
    if kind == "hunyuanvideo":
        return {**inputs, "encoder_hidden_states": embeds, "encoder_attention_mask": mask}
    kwargs_name = "joint_attention_kwargs" if kind == "sd3" else "attention_kwargs"
    return {**inputs, "encoder_hidden_states": embeds, kwargs_name: {"encoder_hidden_states_mask": mask}}


def _output(result, return_dict: bool) -> torch.Tensor:
    return result.sample if return_dict else result[0]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def compare_model(
    kind: str, backend: str, return_dict: bool, world: int, seed: int = 0, ring: int = 1
) -> dict:
    import sp_diffusers
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    base, overrides = VARIANTS.get(kind, (kind, {}))
    model = tiny_model(base, seed=seed, **overrides)
    reference = copy.deepcopy(model)
    inputs = tiny_inputs(base, model, batch=2, seed=seed + 1, **TEXT.get(kind, {}))
    g = torch.Generator().manual_seed(seed + 2)

    ref_out = _output(reference(**inputs, return_dict=return_dict), return_dict)
    weight = torch.randn(ref_out.shape, generator=g)
    (ref_out * weight).mean().backward()
    ref_grads = _grads(reference)

    model.set_attention_backend(backend)
    model.enable_parallelism(
        config=sp_diffusers.context_parallel_config(ulysses_degree=world // ring, ring_degree=ring)
    )
    out = _output(model(**_sp_inputs(kind, inputs, world), return_dict=return_dict), return_dict)
    (out * weight).mean().backward()
    local = _grads(model)
    summed = {n: t.clone() for n, t in local.items()}
    for t in summed.values():
        dist.all_reduce(t)

    # allclose criterion: |a - b| <= atol + rtol * |b|; reported as the worst excess over rtol * |b|.
    grad_err = max(
        (summed[n] - ref_grads[n]).abs().sub(RTOL * ref_grads[n].abs()).max().item() for n in ref_grads
    )
    grad_abs = max((summed[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
    grad_rel = max(
        ((summed[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
        for n in ref_grads
        if ref_grads[n].abs().max() > 0
    )
    # Without the SUM each rank's gradient is only its share: the contract must be visible.
    local_rel = max(
        ((local[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
        for n in ref_grads
        if ref_grads[n].abs().max() > 0
    )
    return {
        "out_err": (out - ref_out).abs().sub(RTOL * ref_out.abs()).max().item(),
        "out_abs": (out - ref_out).abs().max().item(),
        "out_scale": ref_out.abs().max().item(),
        "grad_err": grad_err,
        "grad_abs": grad_abs,
        "grad_rel": grad_rel,
        "local_only_rel": local_rel,
        "n_params": len(ref_grads),
        "n_params_with_grad": sum(1 for t in ref_grads.values() if t.abs().max() > 0),
    }


def model_parity(
    rank: int, world: int, kinds: list[str], backends: list[str], return_dicts: list[bool], ring: int = 1
) -> dict:
    import diffusers

    import sp_diffusers

    _quiet()
    report = sp_diffusers.install()
    results: dict[str, dict] = {}
    for kind in kinds:
        for backend in backends:
            for rd in return_dicts:
                key = f"{kind}/{backend}/return_dict={rd}"
                try:
                    results[key] = compare_model(kind, backend, rd, world, ring=ring)
                except Exception as err:  # reported per case; the parent asserts
                    results[key] = {"error": f"{type(err).__name__}: {err}"}
                dist.barrier()
    return {
        "diffusers": diffusers.__version__,
        "applied": list(report.applied),
        "results": results,
    }
