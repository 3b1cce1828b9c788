"""Plan-driven forwards whose ranks disagree, or whose model breaks the per-forward scope's assumption: the
same clear error on every rank, promptly; and the switches (``trusted``, ``per_call``) that change how the
ranks agree. Runs on 2 ranks; each case builds its own tiny model."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .model_cases import build, outputs


def _case(fn) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = fn()
    except Exception as err:
        result = {"type": type(err).__name__, "message": str(err)}
    else:
        result = {"type": None, "message": None, "value": value}
    result["seconds"] = time.monotonic() - start
    dist.barrier()  # every rank got here: nobody is stuck in a collective
    return result


def forward_agreement(rank: int, world: int) -> dict:
    import logging

    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.parallel.agreement import set_rank_agreement

    dlogging.set_verbosity(logging.ERROR)
    sp_diffusers.install()
    mesh = sp_diffusers.build_device_mesh(ulysses_degree=world)

    def model(name: str = "flux", length: str = "even", **overrides):
        m, inputs = build(name, length, seed=0)
        if overrides:
            from sp_diffusers.tiny import tiny_model

            m = tiny_model(name, seed=0, **overrides)
        m.set_attention_backend("ulysses_sdpa")
        m.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=world, mesh=mesh))
        return m, inputs

    def run(m, inputs) -> float:
        return float(sum(o.double().sum() for o in outputs(m(**inputs, return_dict=False))))

    out: dict[str, Any] = {}

    def text_differs():
        m, inputs = model()
        if rank == 1:
            inputs = {**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][:, :4]}
            inputs["txt_ids"] = (
                inputs["txt_ids"][:4] if inputs["txt_ids"].dim() == 2 else inputs["txt_ids"][:, :4]
            )
        return run(m, inputs)

    def dtype_differs():
        m, inputs = model()
        if rank == 1:
            m = m.double()
            inputs = {
                k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in inputs.items()
            }
        return run(m, inputs)

    def mask_on_one_rank():
        m, inputs = model("sd3", "even")
        from sp_diffusers.parallel.padding import pad_text_batch

        embeds, mask = pad_text_batch(inputs["encoder_hidden_states"], None, world)
        inputs = {**inputs, "encoder_hidden_states": embeds}
        if rank == 0:
            inputs["joint_attention_kwargs"] = {"encoder_hidden_states_mask": mask}
        return run(m, inputs)

    def model_differs():
        m, inputs = model("flux", "even", **({"num_layers": 2} if rank == 1 else {}))
        return run(m, inputs)

    def local_error_everywhere():
        # every rank's processors hand attention a 5-D mask: each rank refuses it on its own, none waits
        from diffusers.models import attention_dispatch

        m, inputs = model()
        original = attention_dispatch.dispatch_attention_fn

        def five_d(query, key, value, attn_mask=None, **kwargs):
            mask = torch.ones((1, 1, 1, 1, key.shape[1]), dtype=torch.bool)
            return original(query, key, value, attn_mask=mask, **kwargs)

        from diffusers.models.transformers import transformer_flux

        transformer_flux.dispatch_attention_fn = five_d
        try:
            return run(m, inputs)
        finally:
            transformer_flux.dispatch_attention_fn = original

    def modes_agree():
        values = {}
        for mode in ("per_forward", "trusted", "per_call"):
            m, inputs = model("flux", "uneven")
            set_rank_agreement(m, mode)
            values[mode] = run(m, inputs)
        return values

    def rank_dependent_sequence():
        # a processor that drops one query/key row on rank 0 only: the sequence is neither split by the plan
        # nor whole on every rank; debug_checks (per_call) says so on every rank
        from diffusers.models import attention_dispatch
        from diffusers.models.transformers import transformer_flux

        m, inputs = model()
        set_rank_agreement(m, "per_call")
        original = attention_dispatch.dispatch_attention_fn

        def uneven_rows(query, key, value, **kwargs):
            if rank == 0:
                query, key, value = query[:, 1:], key[:, 1:], value[:, 1:]
            return original(query, key, value, **kwargs)

        transformer_flux.dispatch_attention_fn = uneven_rows
        try:
            return run(m, inputs)
        finally:
            transformer_flux.dispatch_attention_fn = original

    for name, fn in (
        ("text_differs", text_differs),
        ("dtype_differs", dtype_differs),
        ("mask_on_one_rank", mask_on_one_rank),
        ("model_differs", model_differs),
        ("local_error_everywhere", local_error_everywhere),
        ("modes_agree", modes_agree),
        ("rank_dependent_sequence", rank_dependent_sequence),
    ):
        out[name] = _case(fn)
    return out
