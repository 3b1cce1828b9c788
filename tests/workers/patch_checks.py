"""Each patch: does the defect show without it (where the probe says so), and is it gone with it?

Runs on 2 gloo ranks inside one diffusers version of the matrix. ``install()`` applies every needed
patch; each check then reverts one patch, provokes the defect, re-applies it and repeats the call.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import max_err, shard, summed_grads, ulysses_parallel_config
from .plan_patch_checks import plan_checks


def _quiet() -> None:
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)


def _try(fn):
    try:
        return fn(), None
    except Exception as err:  # the caller records what happened
        return None, f"{type(err).__name__}: {err}"


def _sp_model(kind: str, backend: str, world: int, seed: int = 0):
    import sp_diffusers
    from sp_diffusers.tiny import tiny_model

    model = tiny_model(kind, seed=seed)
    reference = copy.deepcopy(model)
    model.set_attention_backend(backend)
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world))
    return model, reference


def _idempotent(patch) -> bool:
    patch.apply()
    patch.apply()
    ok = patch.is_applied()
    patch.revert()
    patch.revert()
    ok = ok and not patch.is_applied()
    patch.apply()
    return ok and patch.is_applied()


def check_cpu_device_count(world: int) -> dict:
    from sp_diffusers.patching.patches import cpu_device_count as patch
    from sp_diffusers.tiny import tiny_model

    def enable():
        import sp_diffusers

        m = tiny_model("flux")
        m.set_attention_backend("ulysses_sdpa")
        m.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world))
        return True

    was_applied = patch.is_applied()
    patch.revert()
    _, defect = _try(enable)
    if was_applied:
        patch.apply()
    fixed, fixed_err = _try(enable)
    return {"defect": defect, "fixed": bool(fixed), "fixed_error": fixed_err}


def check_root_hook_return_dict(world: int) -> dict:
    from sp_diffusers.patching.patches import root_hook_return_dict as patch
    from sp_diffusers.tiny import tiny_inputs

    # diffusers binds hook.post_forward when the hook is registered (in enable_parallelism), so each
    # variant gets a model built after the patch state is set.
    was_applied = patch.is_applied()
    patch.revert()
    model, _ = _sp_model("flux", "ulysses_sdpa", world)
    inputs = tiny_inputs("flux", model)
    _, defect = _try(lambda: model(**inputs, return_dict=True))
    if was_applied:
        patch.apply()
    model, _ = _sp_model("flux", "ulysses_sdpa", world)
    out, fixed_err = _try(lambda: model(**inputs, return_dict=True).sample)
    return {"defect": defect, "fixed": out is not None, "fixed_error": fixed_err}


def check_qwenimage_joint_mask(world: int) -> dict:
    from sp_diffusers.patching.patches import qwenimage_joint_mask as patch
    from sp_diffusers.tiny import tiny_inputs

    model, reference = _sp_model("qwenimage", "ulysses_sdpa", world)
    inputs = tiny_inputs("qwenimage", model, batch=2, seed=3)
    with torch.no_grad():
        ref = reference(**inputs, return_dict=False)[0]
        was_applied = patch.is_applied()
        patch.revert()
        unpatched, unpatched_err = _try(lambda: model(**inputs, return_dict=False)[0])
        if was_applied:
            patch.apply()
        patched = model(**inputs, return_dict=False)[0]
    if unpatched_err is None:
        err = max_err(unpatched, ref)
        defect = f"output differs from one process by {err:.2e}" if err > 1e-3 else None
    else:
        defect = unpatched_err
    return {"defect": defect, "fixed": max_err(patched, ref) < 1e-4, "patched_err": max_err(patched, ref)}


def check_backend_leak(world: int) -> dict:
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from sp_diffusers.patching.patches import backend_leak as patch
    from sp_diffusers.tiny import tiny_model

    def leaks() -> bool:
        _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE
        tiny_model("flux").set_attention_backend("ulysses_sdpa")
        leaked = _AttentionBackendRegistry._active_backend is not AttentionBackendName.NATIVE
        _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE
        return leaked

    was_applied = patch.is_applied()
    patch.revert()
    defect = "process-wide default switched to ulysses_sdpa" if leaks() else None
    if was_applied:
        patch.apply()
    return {"defect": defect, "fixed": not leaks()}


def check_native_ulysses(world: int) -> dict:
    """Native Ulysses without the patch: broken backward (0.36/0.37), or a second SDPA forward inside
    backward (0.38+), and per-head masks / S_q != S_kv backward failing; with it: exact, no recompute."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from sp_diffusers.parallel.attention import local_sdpa_attention
    from sp_diffusers.patching.patches import native_ulysses as patch

    rank = dist.get_rank()
    config = ulysses_parallel_config(world)
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 8 * world, 2 * world, 8
    q, k, v = (torch.randn(B, S, H, D, generator=g) for _ in range(3))
    k_long, v_long = (torch.randn(B, 2 * S, H, D, generator=g) for _ in range(2))
    head_mask = torch.rand(B, H, S, S, generator=g) > 0.3
    head_mask[..., 0] = True

    calls = {"sdpa": 0}
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def run(query, key, value, mask=None) -> tuple[float, int]:
        """Max error of output and input gradients vs one process; SDPA calls made during backward."""
        fn = _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]
        ref_in = [t.clone().requires_grad_(True) for t in (query, key, value)]
        ref = local_sdpa_attention(*ref_in, attn_mask=mask)
        ref.backward(torch.ones_like(ref))
        sp_in = [shard(t, 1, rank, world).clone().requires_grad_(True) for t in (query, key, value)]
        out = fn(*sp_in, attn_mask=mask, _parallel_config=config)
        F.scaled_dot_product_attention = counting_sdpa
        calls["sdpa"] = 0
        try:
            out.backward(torch.ones_like(out))
        finally:
            F.scaled_dot_product_attention = real_sdpa
        errs = [max_err(out, shard(ref, 1, rank, world))]
        errs += [max_err(a.grad, shard(b.grad, 1, rank, world)) for a, b in zip(sp_in, ref_in, strict=True)]
        return max(errs), calls["sdpa"]

    results: dict = {}
    was_applied = patch.is_applied()
    patch.revert()
    observed = []
    plain, plain_err = _try(lambda: run(q, k, v))
    if plain_err:
        observed.append(f"backward fails: {plain_err[:120]}")
    elif plain[1] > 0:
        observed.append(f"backward recomputes the forward ({plain[1]} SDPA call(s))")
    elif plain[0] > 1e-5:
        observed.append(f"wrong gradients ({plain[0]:.2e})")
    head, head_err = _try(lambda: run(q, k, v, head_mask))
    if head_err or head[0] > 1e-5:
        observed.append("per-head mask fails" + (f": {head_err[:80]}" if head_err else f" ({head[0]:.2e})"))
    cross, cross_err = _try(lambda: run(q, k_long, v_long))
    if cross_err or cross[0] > 1e-5:
        observed.append("S_q != S_kv fails" + (f": {cross_err[:80]}" if cross_err else f" ({cross[0]:.2e})"))
    dist.barrier()
    if was_applied:
        patch.apply()
    fixed = {
        name: run(*args)
        for name, args in (
            ("plain", (q, k, v)),
            ("per_head", (q, k, v, head_mask)),
            ("cross", (q, k_long, v_long)),
        )
    }
    results["defect"] = "; ".join(observed) or None
    results["fixed"] = all(err <= 1e-5 and n_sdpa == 0 for err, n_sdpa in fixed.values())
    results["fixed_detail"] = {k: {"err": e, "sdpa_calls_in_backward": n} for k, (e, n) in fixed.items()}
    return results


def check_mesh_injection(world: int) -> dict:
    """DP x SP on one shared mesh: impossible on 0.36/0.37 without the patch, exact with it."""
    import sp_diffusers
    from sp_diffusers.patching.compat import config_accepts_mesh
    from sp_diffusers.patching.patches import mesh_injection as patch
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    sp = world // 2
    mesh = sp_diffusers.build_device_mesh(ulysses_degree=sp)
    model = tiny_model("wan")
    reference = copy.deepcopy(model)
    inputs = tiny_inputs("wan", model, seed=5)

    defect = None
    if not config_accepts_mesh():
        was_applied = patch.is_applied()
        patch.revert()
        m = tiny_model("wan")
        m.set_attention_backend("ulysses_sdpa")
        from diffusers import ContextParallelConfig

        cfg = ContextParallelConfig(ulysses_degree=sp)
        setattr(cfg, patch.INJECTED_MESH_ATTR, mesh)
        _, defect = _try(lambda: m.enable_parallelism(config=cfg))
        defect = defect or "shared mesh ignored"
        dist.barrier()
        if was_applied:
            patch.apply()
    model.set_attention_backend("ulysses_sdpa")
    model.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=sp, mesh=mesh))
    with torch.no_grad():
        err = max_err(model(**inputs, return_dict=False)[0], reference(**inputs, return_dict=False)[0])
    return {"defect": defect, "fixed": err < 1e-4, "dp_sp_err": err}


def check_uneven_sharding(world: int) -> dict:
    """A tiny Flux with 7 text tokens and 3 x 3 image tokens: no length divides the degree."""
    from sp_diffusers.patching.patches import uneven_sharding as patch
    from sp_diffusers.tiny import tiny_inputs

    model, reference = _sp_model("flux", "ulysses_sdpa", world)
    inputs = tiny_inputs("flux", model, batch=2, seed=3, text_len=7, image_hw=(3, 3))
    ref = reference(**inputs, return_dict=False)[0]
    was_applied = patch.is_applied()
    patch.revert()
    _, defect = _try(lambda: model(**inputs, return_dict=False)[0])
    if was_applied:
        patch.apply()
    out = model(**inputs, return_dict=False)[0]
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    (ref * weight).mean().backward()  # mean: O(1) gradients, the model-parity tolerance applies
    (out * weight).mean().backward()
    grad_err = 0.0
    for g, p_ref in zip(summed_grads(model), reference.parameters(), strict=True):
        g_ref = p_ref.grad if p_ref.grad is not None else torch.zeros_like(p_ref)
        grad_err = max(grad_err, (g - g_ref).abs().sub(1e-4 * g_ref.abs()).max().item())
    out_err = (out - ref).abs().sub(1e-4 * ref.abs()).max().item()
    return {
        "defect": defect,
        "fixed": out_err <= 1e-5 and grad_err <= 1e-5 and type(out) is torch.Tensor,
        "out_err": out_err,
        "grad_err": grad_err,
    }


CHECKS = {
    "cpu_device_count": check_cpu_device_count,
    "root_hook_return_dict": check_root_hook_return_dict,
    "qwenimage_joint_mask": check_qwenimage_joint_mask,
    "backend_leak": check_backend_leak,
    "native_ulysses": check_native_ulysses,
    "mesh_injection": check_mesh_injection,
    "uneven_sharding": check_uneven_sharding,
}


def patch_checks(rank: int, world: int) -> dict:
    import diffusers

    import sp_diffusers
    from sp_diffusers.patching.patches import ALL_PATCHES

    _quiet()
    report = sp_diffusers.install()
    out: dict = {"diffusers": diffusers.__version__, "probe": {}, "checks": {}, "idempotent": {}}
    for status in report.patches:
        out["probe"][status.name] = status.applied
    for name, check in CHECKS.items():
        if name == "mesh_injection" and world < 4:
            continue
        out["checks"][name] = check(world)
        dist.barrier()
    out["checks"].update(plan_checks(world))
    for patch in ALL_PATCHES:
        if out["probe"][patch.NAME]:
            out["idempotent"][patch.NAME] = _idempotent(patch)
    # uninstall reverts everything and leaves diffusers as it was; a second install re-applies the same set
    sp_diffusers.uninstall()
    out["after_uninstall_applied"] = [p.NAME for p in ALL_PATCHES if p.is_applied()]
    from diffusers.models.attention_dispatch import AttentionBackendName

    out["backend_after_uninstall"] = "ulysses_sdpa" in {m.value for m in AttentionBackendName}
    again = sp_diffusers.install()
    out["reinstall_same"] = list(again.applied) == list(report.applied)
    out["report"] = str(report)
    return out
