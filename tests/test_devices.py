"""``sp_diffusers.parallel.devices`` and the host reads of the rollout/update path, in one process.

Host reads are counted by a dispatch mode on ``aten._local_scalar_dense`` (what ``.item()``, ``float()``,
``bool()`` of a tensor dispatch to): on CPU they cost nothing, on a GPU each one stops the host until the GPU
drains, so the paths that run per denoising step or per micro-step must not make any.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sp_diffusers.parallel.devices import (
    collective_device,
    default_device,
    device_of,
    fetch_scalars,
    to_device,
)


@contextlib.contextmanager
def host_reads() -> Iterator[list[str]]:
    seen: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Reads():
        yield seen


def test_devices_helpers():
    assert collective_device() == torch.device("cpu")  # no process group: the CPU
    if not torch.cuda.is_available():
        assert default_device() == torch.device("cpu")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), torch.zeros(2)], "c": "text", "d": (torch.ones(1),)}
    moved = to_device(batch, torch.device("meta"))
    assert moved["a"].is_meta and all(t.is_meta for t in moved["b"]) and moved["c"] == "text"
    assert isinstance(moved["d"], tuple) and moved["d"][0].is_meta
    assert device_of("x", [1, torch.ones(1, device="meta")]) == torch.device("meta")
    assert device_of("x", 3) == torch.device("cpu")
    # one read for every metric of a step, lists included; other values untouched
    got = fetch_scalars(
        {"loss": torch.tensor(0.5), "per_micro": [torch.tensor(1.0), torch.tensor([2.0])], "n": 3}
    )
    assert got == {"loss": 0.5, "per_micro": [1.0, 2.0], "n": 3}


def test_step_rule_with_per_sample_steps_reads_nothing_back():
    """A ``[B]`` step index (DanceGRPO, every update): the sigmas are gathered where the index lives; python
    sigmas (int steps) are filled on the sample's device (``torch.full``), not copied from the host."""
    from sp_diffusers.flowgrpo.sampling.pipeline_schedule import linspace_schedule
    from sp_diffusers.flowgrpo.sampling.sde import StepRule, ode_step

    schedule = linspace_schedule(6, 3.0)
    x, v = torch.randn(3, 8, 4), torch.randn(3, 8, 4)
    idx = torch.tensor([0, 2, 4])
    for sde_type in ("sde", "cps", "dance"):
        rule = StepRule(sde_type, 0.5)
        nxt = rule.step(x, v, schedule.sigmas, idx, generator=torch.Generator().manual_seed(0)).prev_sample
        with host_reads() as reads:
            step = rule.step(x, v, schedule.sigmas, idx, prev_sample=nxt)
        assert reads == [], sde_type
        assert torch.isfinite(step.log_prob).all()
        # on a device the host cannot read (meta stands in for a GPU): bringing the index to the host would raise
        meta = [t.to("meta") for t in (x, v, idx, nxt)]
        assert rule.step(*meta[:2], schedule.sigmas, meta[2], prev_sample=meta[3]).log_prob.is_meta
    with host_reads() as reads:
        assert ode_step(x.to("meta"), v.to("meta"), 0.8, 0.6).is_meta  # python sigmas filled there
    assert reads == []
    on = schedule.on(torch.device("meta"))
    assert on.sigmas.is_meta and schedule.on(torch.device("meta")) is on  # copied once, kept
