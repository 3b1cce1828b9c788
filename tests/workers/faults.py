"""Fault handling on real ranks: a non-finite loss on one rank skips the step on every rank; SP peers with
different parameters are refused."""

from __future__ import annotations

import logging

import torch


def non_finite_and_divergent_parameters(rank: int, world: int) -> dict:
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.engine import SPDivergenceError
    from sp_diffusers.tiny import tiny_inputs, tiny_model

    dlogging.set_verbosity(logging.ERROR)
    out = {}
    engine = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1), ulysses_sequence_parallel_size=world
    )
    inputs = tiny_inputs("qwenimage", tiny_model("qwenimage", num_layers=1), batch=1, text_len=8)
    inputs = {k: (v.to(engine.device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}

    def loss_fn(eng, batch):
        loss = eng.forward(**inputs).square().mean()
        if rank == world - 1:  # only the last rank sees a NaN (e.g. an overflow in its sequence shard)
            loss = loss * float("nan")
        return loss, {}

    metrics = engine.train_step({}, loss_fn)
    out["skipped"] = metrics["step_skipped"]
    out["grad_norm_finite"] = bool(torch.isfinite(torch.tensor(metrics["grad_norm"])))
    out["params_unchanged"] = all(
        torch.equal(before[n], p.full_tensor()) for n, p in engine.model.named_parameters()
    )
    out["global_step"] = engine.global_step
    metrics = engine.train_step({}, lambda eng, b: (eng.forward(**inputs).square().mean(), {}))
    out["next_step_taken"] = metrics["step_skipped"] == 0.0 and engine.global_step == 1

    replicas = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1),
        ulysses_sequence_parallel_size=world,
        use_fsdp=False,
        debug_checks=True,
    )
    with torch.no_grad():
        next(replicas.model.parameters()).add_(float(rank) * 1e-3)  # a replica that drifted
    try:
        replicas.train_step({}, lambda eng, b: (eng.forward(**inputs).square().mean(), {}))
        out["divergent_parameters"] = None
    except SPDivergenceError as err:
        out["divergent_parameters"] = str(err)
    return out
