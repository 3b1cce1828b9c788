"""One FlowGRPO policy update at SP = 2: ours vs the verl-omni-style path vs one process.

    python benchmarks/train_step.py [--image-size 128] [--layers 2] [--samples 2] [--json out.json]

- ours: ``FSDPEngine`` (FSDP2 + ``ulysses_sdpa``, gradient contract by the divide factor);
- verl-omni-style: the same FSDP2 engine on diffusers' own ``native`` Ulysses attention as diffusers 0.42
  ships it (this process does not keep the ``native_ulysses`` patch), FSDP's default MEAN over all ranks and
  the loss multiplied by the SP degree by hand, as verl-omni's diffusers engine does;
- one process: the same update on one rank with all samples' sequence (run separately, 1 process).
Same model, data and micro-batching everywhere; ours and verl-omni-style run round-robin in one 2-rank
job, medians of --repeats. Reports samples/s and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import (
    achieved,
    add_device_arguments,
    count_flops,
    max_over_ranks,
    peak_bytes,
    spawn,
    synchronize,
    write_json,
)


def _make(args, backend: str):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.image_size, c.model.overrides = args.image_size, {"num_layers": args.layers}
    c.parallel.ulysses_sequence_parallel_size = dist.get_world_size()
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 6, 2, [1, 2]
    c.flowgrpo.micro_batch_size = args.samples // 2
    c.train.progress = c.train.plot = False
    torch.manual_seed(0)
    trainer = FlowGRPOTrainer(c)
    if backend == "native":
        from sp_diffusers.patching.patches import native_ulysses

        native_ulysses.revert()  # diffusers' own Ulysses: recomputing backward, as shipped
        trainer.engine.model.set_attention_backend("native")
        world = dist.get_world_size()
        for m in trainer.engine.model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(float(world))  # FSDP's default MEAN over every rank
        sp = trainer.engine.sp_size
        original = trainer.engine.forward_backward
        trainer.engine.forward_backward = lambda batch, fn, loss_scale=1.0: original(
            batch, fn, loss_scale * sp
        )
    return trainer


def _data(trainer, samples: int):
    from sp_diffusers.flowgrpo.batch import IterationBatch
    from sp_diffusers.flowgrpo.models.text import DEFAULT_PROMPTS
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(samples)]
    embeds, masks = trainer.text_encoder.encode(prompts)
    cond = {"prompt_embeds": embeds, "prompt_embeds_mask": masks}
    batch = IterationBatch(prompts, cond, torch.arange(samples), torch.zeros(samples), shuffle_seed=1)
    batch = batch.prepared(trainer.engine)
    device = trainer.engine.device
    latents = torch.randn(samples, 3, *trainer.adapter.latent_shape(samples)[1:], generator=g).to(device)
    traj = Trajectory(latents, torch.zeros(samples, 2, device=device), 1, latents[:, -1])
    advantages = torch.randn(samples, generator=g).to(device)
    return batch, traj, advantages, torch.zeros(samples, 2, device=device)


def bench_rank(rank: int, world: int, args) -> dict:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    variants = {}
    # native first: reverting its patch must not leak into ours (ours never calls the native backend)
    for name, backend in (("verl_omni_style", "native"), ("ours", "ulysses_sdpa")):
        trainer = _make(args, backend)
        variants[name] = (trainer, *_data(trainer, args.samples))

    def step(name):
        trainer, batch, traj, adv, old = variants[name]
        trainer.update(batch, traj, adv, old)

    for name in variants:
        step(name)
    samples = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            synchronize()
            dist.barrier()
            t = time.perf_counter()
            step(name)
            synchronize()
            samples[name].append(time.perf_counter() - t)
    out = {"time_s": {}, "peak_mib": {}, "tflops_per_rank": {}}
    for name in variants:
        out["time_s"][name] = max_over_ranks(statistics.median(samples[name]))
        out["peak_mib"][name] = max_over_ranks(peak_bytes(lambda name=name: step(name)) / 2**20)
        flops = count_flops(lambda name=name: step(name))  # this rank's: its shard of the sequence
        out["tflops_per_rank"][name] = achieved(flops, out["time_s"][name], torch.float32)
    return out


def single_rank(rank: int, world: int, args) -> dict:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    trainer = _make(args, "ulysses_sdpa")
    data = _data(trainer, args.samples)
    trainer.update(*data)
    times = []
    for _ in range(args.repeats):
        synchronize()
        t = time.perf_counter()
        trainer.update(*data)
        synchronize()
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    flops = count_flops(lambda: trainer.update(*data))
    return {
        "time_s": seconds,
        "peak_mib": peak_bytes(lambda: trainer.update(*data)) / 2**20,
        "tflops": achieved(flops, seconds, torch.float32),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=128, help="latent size; tokens = (size/2)^2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    sp = spawn(bench_rank, 2, args, backend=args.backend, device=args.device)[0]
    one = spawn(single_rank, 1, args, backend=args.backend, device=args.device)[0]
    t = sp["time_s"]
    rate = {k: args.samples / v for k, v in t.items()}
    rate["one_process"] = args.samples / one["time_s"]
    tokens = (args.image_size // 2) ** 2
    print(
        f"\nFlowGRPO update, tiny Qwen-Image ({args.layers} layers, {tokens} image tokens), {args.samples} samples, "
        f"2 micro-batches x 2 window steps, fp32, {args.backend} on {args.device}"
    )
    for name in ("one_process", "verl_omni_style", "ours"):
        mem = one["peak_mib"] if name == "one_process" else sp["peak_mib"][name]
        tf = one["tflops"] if name == "one_process" else sp["tflops_per_rank"][name]
        frac = f" ({tf['fraction_of_peak']:.2f} of peak)" if tf["fraction_of_peak"] else ""
        print(
            f"  {name:<16} {rate[name]:7.2f} samples/s   peak {mem:6.1f} MiB per rank   "
            f"{tf['tflops']:.3g} TFLOP/s per rank{frac}"
        )
    print(f"  ours / verl-omni-style: {rate['ours'] / rate['verl_omni_style']:.3f}x (target >= 1.25)")
    print(f"  ours / one process:     {rate['ours'] / rate['one_process']:.3f}x")
    write_json(args.json, {"args": vars(args), "sp": sp, "one_process": one, "samples_per_s": rate})
    return 0


if __name__ == "__main__":
    sys.exit(main())
