"""One FlowGRPO update of a narrow Wan at a long video sequence: SP = 2 vs one process vs verl-omni-style.

    python benchmarks/video_train_step.py [--frames 16 --size 64] [--layers 2] [--repeats 3] [--json out.json]

tokens = frames x (size / 2)^2 (patch (1, 2, 2)): the default 16 x 32 x 32 = 16384.

- one process: ``FlowGRPOTrainer`` on one rank (the whole sequence);
- ours: the same trainer at SP = 2 on 2 ranks (``FSDPEngine``: FSDP2 + ``ulysses_sdpa``, the gradient
  contract by the divide factor);
- verl-omni-style: the same FSDP2 engine on 2 ranks with diffusers' own ``native`` Ulysses attention as
  diffusers ships it (this benchmark reverts sp_diffusers' ``native_ulysses`` patch), FSDP's default MEAN
  over all ranks and the loss multiplied by the SP degree by hand, as verl-omni's diffusers engine does.

One run, interleaved: a persistent 2-rank group (ours, verl-omni-style) and two persistent 1-rank processes
take turns, commanded by this parent process, so every repetition times each variant once under the same machine
conditions; the idle ones wait on a queue (no CPU). The two 1-rank processes run the one-process update at the
same time (as ``benchmarks/scaling.py`` measures T1): every variant then keeps both cores busy, so the baseline
sees the same load as SP does (on a shared 2-core box a lone process would get a core, memory bandwidth and
cache to itself); E = T1 / (2 T2). Medians of ``--repeats``; then one profiled pass each
for the peak memory per rank (above what is live before the update: the model and the trajectory excluded).
Every variant runs the same update on the same data (one video, 2 window steps, on-policy old log-probs), so
their gradient norms agree (reported: a wrong gradient contract would show there).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import (
    add_device_arguments,
    peak_bytes,
    rank_context,
    synchronize,
    take_environment,
    write_json,
)

# a narrow Wan: 2 heads x 16 (the 3-axis RoPE needs head_dim >= 6), hidden 32
NARROW = dict(
    num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32, rope_max_seq_len=64
)


def _trainer(args, sp: int, backend: str):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.kind, c.model.image_size, c.model.frames = "wan", args.size, args.frames
    c.model.overrides = {**NARROW, "num_layers": args.layers}
    c.text.max_sequence_length = 16
    c.parallel.ulysses_sequence_parallel_size = sp
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 6, 2, [1, 2]
    c.flowgrpo.micro_batch_size = 1
    c.flowgrpo.drop_zero_advantage = False
    # lr 0: the optimizer step still runs, but the parameters (and so the on-policy ratio 1, the unclipped
    # gradient and its norm) stay the same over the repetitions and agree across the variants
    c.optim.lr = 0.0
    c.train.out_dir, c.train.progress, c.train.plot = tempfile.mkdtemp(), False, False
    torch.manual_seed(0)
    trainer = FlowGRPOTrainer(c)
    if backend == "native":
        from sp_diffusers.patching.patches import native_ulysses

        native_ulysses.revert()  # diffusers' own Ulysses, as shipped
        trainer.engine.model.set_attention_backend("native")
        for m in trainer.engine.model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(float(dist.get_world_size()))  # FSDP's default MEAN
        original = trainer.engine.forward_backward
        trainer.engine.forward_backward = lambda batch, fn, loss_scale=1.0: original(
            batch, fn, loss_scale * sp
        )
    return trainer


def _data(trainer) -> tuple:
    from sp_diffusers.flowgrpo.batch import IterationBatch
    from sp_diffusers.flowgrpo.sampling.denoise import Sampler, evaluate_step
    from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    prompts = ["a red lighthouse at dusk"]
    cond = trainer.text_encoder.encode_batch(prompts)
    batch = IterationBatch(prompts, cond, torch.arange(1), torch.zeros(1), shuffle_seed=1).prepared(trainer.engine)
    shape = trainer.adapter.latent_shape(1)
    device = trainer.engine.device
    latents = torch.randn(1, 3, *shape[1:], generator=g).to(device)
    traj = Trajectory(latents, torch.zeros(1, 2, device=device), 1, latents[:, -1])
    with trainer.engine.eval_mode():  # on-policy old log-probs: real, unclipped gradients
        old = torch.stack(
            [
                evaluate_step(
                    Sampler(trainer.engine, trainer.adapter, trainer.schedule),
                    latents[:, k],
                    latents[:, k + 1],
                    1 + k,
                    batch.cond,
                    trainer.rule,
                ).log_prob
                for k in range(2)
            ],
            dim=1,
        )
    return batch, traj, torch.ones(1, device=device), old


def _worker(rank: int, world: int, init: str, args, env: dict, inbox, outbox, gpu: int = 0) -> None:
    take_environment(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["SP_BENCH_DEVICE"] = args.device
    if args.device == "cuda":
        torch.cuda.set_device(gpu % torch.cuda.device_count())
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=3600),
    )
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    try:
        # native first: reverting its patch must not leak into ours (ours never calls the native backend)
        names = (
            (("verl_omni_style", "native"), ("ours", "ulysses_sdpa"))
            if world == 2
            else (("one_process", ""),)
        )
        variants = {}
        for name, backend in names:
            trainer = _trainer(args, world, backend)
            variants[name] = (trainer, *_data(trainer))
        last = {}

        def step(name):
            trainer, batch, traj, adv, old = variants[name]
            last[name] = trainer.update(batch, traj, adv, old)

        for name in variants:
            step(name)  # warm-up
        outbox.put((rank, "ready", None))
        while (cmd := inbox.get()) != "stop":
            kind, name = cmd
            dist.barrier()
            if kind == "time":
                synchronize()
                t = time.perf_counter()
                step(name)
                synchronize()
                outbox.put((rank, name, time.perf_counter() - t))
            else:
                mib = peak_bytes(lambda name=name: step(name)) / 2**20
                outbox.put((rank, name, {"peak_mib": mib, "grad_norm": last[name]["grad_norm"]}))
    except BaseException as err:
        import traceback

        outbox.put((rank, "error", f"{err!r}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _command(group: list, outbox, cmd) -> list:
    for inbox in group:
        inbox.put(cmd)
    got = [outbox.get(timeout=7200) for _ in group]
    for _, name, payload in got:
        if name == "error":
            raise RuntimeError(payload)
    return [payload for _, _, payload in sorted(got, key=lambda x: x[0])]


def run(args) -> dict:
    ctx = rank_context()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        sp_out, one_out = ctx.Queue(), ctx.Queue()
        sp_in, one_in = [ctx.Queue(), ctx.Queue()], [ctx.Queue(), ctx.Queue()]
        # GPUs: the SP ranks on GPUs 0 and 1, the one-process runs on 2 and 3 (modulo the GPUs there are)
        procs = [
            ctx.Process(target=_worker, args=(r, 2, f"{tmp}/sp", args, env, sp_in[r], sp_out, r))
            for r in range(2)
        ] + [
            ctx.Process(target=_worker, args=(0, 1, f"{tmp}/one{i}", args, env, one_in[i], one_out, 2 + i))
            for i in range(2)
        ]
        for p in procs:
            p.start()
        try:
            for outbox, n in ((sp_out, 2), (one_out, 2)):  # every process built and warmed up
                for _ in range(n):
                    _, name, payload = outbox.get(timeout=7200)
                    if name == "error":
                        raise RuntimeError(payload)
            groups = {
                "verl_omni_style": (sp_in, sp_out),
                "ours": (sp_in, sp_out),
                "one_process": (one_in, one_out),
            }
            times = {name: [] for name in groups}
            for _ in range(args.repeats):
                for name, (inboxes, outbox) in groups.items():
                    times[name].append(max(_command(inboxes, outbox, ("time", name))))
            memory = {
                name: _command(inboxes, outbox, ("memory", name))
                for name, (inboxes, outbox) in groups.items()
            }
        finally:
            for q in (*sp_in, *one_in):
                q.put("stop")
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    time_s = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "tokens": args.frames * (args.size // 2) ** 2,
        "time_s": time_s,
        "times_s": times,
        "peak_mib_per_rank": {name: max(m["peak_mib"] for m in ms) for name, ms in memory.items()},
        "grad_norm": {name: ms[0]["grad_norm"] for name, ms in memory.items()},
        "strong_scaling_efficiency": time_s["one_process"] / (2 * time_s["ours"]),
        "memory_ratio": None,  # filled below
        "ours_over_verl_omni_style": time_s["verl_omni_style"] / time_s["ours"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=16, help="latent frames")
    p.add_argument("--size", type=int, default=64, help="latent height = width (patch 2)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    add_device_arguments(p)
    args = p.parse_args(argv)
    out = run(args)
    mem = out["peak_mib_per_rank"]
    out["memory_ratio"] = mem["ours"] / mem["one_process"]
    t = out["time_s"]
    print(
        f"\nFlowGRPO update, narrow Wan ({args.layers} layers, 2 heads x 16), {out['tokens']} video tokens "
        f"({args.frames} x {args.size // 2} x {args.size // 2}), 1 video, 2 window steps, fp32, {args.backend} on "
        f"{args.device}"
    )
    for name in ("one_process", "verl_omni_style", "ours"):
        print(
            f"  {name:<16} {t[name]:8.2f} s/update   peak {mem[name]:8.1f} MiB per rank   grad norm {out['grad_norm'][name]:.6g}"
        )
    print(f"  strong-scaling efficiency at SP=2: {out['strong_scaling_efficiency']:.3f} (target >= 0.90)")
    print(f"  per-rank peak / one process:       {out['memory_ratio']:.3f} (target <= 0.60)")
    print(f"  ours / verl-omni-style throughput: {out['ours_over_verl_omni_style']:.3f}x (target >= 1.25)")
    write_json(args.json, {"args": vars(args), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
