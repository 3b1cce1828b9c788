"""One FlowGRPO iteration before and after the rollout's weights are gathered once and CFG runs as one forward;
with ``--reward-seconds``, before and after its rewards are scored beside the rollout (``rollout.chunks``).

    python benchmarks/rl_iteration.py [--workload image video] [--steps 16] [--cfg 4] [--repeats 3] [--json out.json]
    python benchmarks/rl_iteration.py --reward-seconds 0.25 [--chunks 1 2 4] [--lag] ...
    python benchmarks/rl_iteration.py --compile ...

Two workloads at SP = 2 on 2 ranks (FSDP2 over both), each a trainer built twice on the same config, differing
only in ``rollout.*``:

- ``before``: ``rollout.gather_params: never`` and ``rollout.cfg_batch: false`` - every denoising step gathers
  every block, CFG runs two forwards (the iteration as it was);
- ``after``: the defaults, ``auto`` (the tiny models fit: gathered once) and ``true``.

``image`` is the README's main job (tiny Qwen-Image, 2 layers, ragged byte-level prompts, 2 prompts x group 4
per rank); ``video`` the video step's narrow Wan (2 layers, 16 latent frames of 32 x 32, patch (1, 2, 2): 16 x 16 x 16 =
4096 video tokens), 1 prompt x group 2. Both at ``--steps`` denoising steps with CFG ``--cfg``,
2 trained steps. The learning rate is 0, so every repetition repeats the same iteration. Iterations run
interleaved (before, after, before, ...; ranks start each together) and the median is reported with the ratio; the
ledger (``sp_diffusers.parallel.ledger``) gives rank 0's bytes per kind of one iteration of each.

``--reward-seconds S``: the rewards come from a reward server (``sp-diffusers reward-server``, started here as its
own process) whose function takes S seconds per sample and returns the latents' mean: a reward model on a device of
its own, whose time the trainer's processes spend waiting (this host's two cores are the two ranks'; a reward
computed on them would share them). The variants differ only in ``rollout.chunks`` (``--chunks``); 1 is the
iteration scored after the rollout.

``--lag`` (with ``--reward-seconds``) adds ``update.lag: 1``: each iteration trains the previous one's rollout,
whose rewards were scored meanwhile (the optional one-step off-policy mode; its first iteration, untimed, trains
nothing).

``--compile``: the "after" iteration eager against ``train.compile: blocks`` (CPU inductor), timed after two
iterations (the first forward of each shape runs eagerly, then the graphs compile).

Every mode also prints each variant's phases (the trainer's ``phase_seconds/<phase>``, medians over the timed
iterations): batch, rollout, old_log_probs, reward (scored there, or the wait for the background scoring), update.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._harness import add_device_arguments, interleaved_times, spawn, write_json

NARROW_WAN = dict(
    num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32, rope_max_seq_len=64
)
VARIANTS = {  # dotted config keys, each variant's
    "before": {"rollout.gather_params": "never", "rollout.cfg_batch": False},
    "after": {"rollout.gather_params": "auto", "rollout.cfg_batch": True},
}


def _config(workload: str, steps: int, cfg: float, settings: dict, group_size: int = 0):
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    if workload == "video":
        c.model.kind, c.model.image_size, c.model.frames = "wan", 32, 16
        c.model.overrides = {**NARROW_WAN, "num_layers": 2}
        c.text.max_sequence_length, c.flowgrpo.reward = 16, "video_color"
        c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 1, 2, 1
    else:  # the README's main job (examples/configs/tiny_qwenimage_sp2.yaml's model)
        c.model.overrides = {"num_layers": 2}
    c.parallel.ulysses_sequence_parallel_size = 2
    c.flowgrpo.num_steps, c.flowgrpo.cfg_scale = steps, cfg
    c.flowgrpo.window_size, c.flowgrpo.window_range = 2, [1, 2]
    c.flowgrpo.drop_zero_advantage = False  # every variant trains the same samples
    c.optim.lr = 0.0  # the same iteration at every repetition
    if group_size:
        c.flowgrpo.group_size = group_size
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    c.train.out_dir, c.train.progress, c.train.plot = tempfile.mkdtemp(), False, False
    return c


LATENCY_REWARD = """
import time


def score(latents, prompts, metadata, seconds_per_sample=0.25):
    time.sleep(seconds_per_sample * len(prompts))
    return latents.float().flatten(1).mean(dim=1)
"""


def _rank(
    rank: int,
    world: int,
    workload: str,
    steps: int,
    cfg: float,
    repeats: int,
    variants: dict | None = None,
    group_size: int = 0,
) -> dict:
    import logging
    import warnings

    from diffusers.utils import logging as dlogging

    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer
    from sp_diffusers.parallel.ledger import CommLedger

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    trainers = {}
    for name, settings in (variants or VARIANTS).items():
        torch.manual_seed(0)
        trainers[name] = FlowGRPOTrainer(_config(workload, steps, cfg, settings, group_size))
    ledgers, rewards, waits = {}, {}, {}
    for name, trainer in trainers.items():
        ledger = CommLedger()
        with ledger.recording():
            trainer.train_iteration(0)
        ledgers[name] = {f"{p}/{k}": list(v) for (p, k), v in ledger.take().items()}
    compiled = any(t.config.train.compile != "off" for t in trainers.values())
    recorded: dict[str, list[dict]] = {name: [] for name in trainers}
    times = interleaved_times(  # a compiled model's second iteration may still compile (the first runs eagerly)
        {name: (lambda n=name, t=trainer: recorded[n].append(t.train_iteration(0))) for name, trainer in trainers.items()},
        repeats,
        warmup=1 if compiled else 0,
    )
    for name, runs in recorded.items():  # the main thread's wait for the background scoring (median)
        rewards[name] = runs[-1]["reward_mean"]  # a timed iteration's (update.lag: the first trains nothing)
        timed = [m["reward_wait_seconds"] for m in runs[-repeats:] if "reward_wait_seconds" in m]
        waits[name] = statistics.median(timed) if timed else None
    phases = {  # each phase's median over the timed iterations (the trainer's phase_seconds/<phase>)
        name: {
            key.split("/", 1)[1]: statistics.median(m[key] for m in runs[-repeats:])
            for key in runs[-1]
            if key.startswith("phase_seconds/")
        }
        for name, runs in recorded.items()
    }
    return {
        "seconds": times,
        "phase_seconds": phases,
        "ledger": ledgers,
        "reward_mean": rewards,
        "reward_wait_seconds": waits,
    }


def _phases(phases: dict[str, float]) -> str:
    """One variant's phases as ``rollout 1.23  update 2.34 ...`` (seconds, in the loop's order)."""
    return "  ".join(f"{k} {v:.2f}" for k, v in phases.items())


def _kinds(ledger: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, (_, nbytes) in ledger.items():
        kind = key.split("/")[1]
        out[kind] = out.get(kind, 0) + nbytes
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", default=["image", "video"], choices=("image", "video"))
    p.add_argument("--steps", type=int, default=16, help="denoising steps per rollout")
    p.add_argument("--cfg", type=float, default=4.0, help="classifier-free guidance scale (1: none)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--reward-seconds", type=float, default=0.0, help="a reward server's seconds per sample")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4], help="rollout.chunks variants")
    p.add_argument("--lag", action="store_true", help="with --reward-seconds: an update.lag 1 variant too")
    p.add_argument("--group-size", type=int, default=0, help="flowgrpo.group_size (0: the workload's)")
    p.add_argument("--compile", action="store_true", help="train.compile off against blocks (CPU inductor)")
    add_device_arguments(p)
    args = p.parse_args(argv)
    if args.reward_seconds > 0:
        return _overlap(args)
    if args.compile:
        return _compiled(args)
    out = {}
    for workload in args.workload:
        r = spawn(_rank, 2, workload, args.steps, args.cfg, args.repeats, backend=args.backend, device=args.device)[0]
        sec = r["seconds"]
        kinds = {name: _kinds(ledger) for name, ledger in r["ledger"].items()}
        out[workload] = {**r, "bytes_by_kind": kinds, "speedup": sec["before"] / sec["after"]}
        print(f"\n{workload}: FlowGRPO iteration at SP 2, {args.steps} steps, CFG {args.cfg:g} ({args.device})")
        for name in VARIANTS:
            moved = "  ".join(f"{k} {v / 2**20:8.2f} MiB" for k, v in sorted(kinds[name].items()))
            print(f"  {name:<7} {sec[name]:7.2f} s/iteration   rank 0 sends: {moved}")
            print(f"  {'':<7} phases (s): {_phases(r['phase_seconds'][name])}")
        gathers = kinds["before"].get("param_gather", 0) / max(1, kinds["after"].get("param_gather", 0))
        print(f"  after / before: {1 / out[workload]['speedup']:.3f} of the time; parameter gathers / {gathers:.1f}")
    write_json(args.json, {"args": vars(args), **out})
    return 0


def _compiled(args: argparse.Namespace) -> int:
    """The iteration eager against compiled (``train.compile: blocks``), after the compiling iterations."""
    out = {}
    for workload in args.workload:
        variants = {mode: {**VARIANTS["after"], "train.compile": mode} for mode in ("off", "blocks")}
        r = spawn(
            _rank, 2, workload, args.steps, args.cfg, args.repeats, variants, args.group_size,
            backend=args.backend, device=args.device,
        )[0]
        sec = r["seconds"]
        out[workload] = {**r, "ratio": sec["blocks"] / sec["off"]}
        print(f"\n{workload}: FlowGRPO iteration at SP 2, {args.steps} steps, CFG {args.cfg:g} ({args.device})")
        print(f"  eager     {sec['off']:7.2f} s/iteration   phases (s): {_phases(r['phase_seconds']['off'])}")
        print(
            f"  compiled  {sec['blocks']:7.2f} s/iteration   {sec['blocks'] / sec['off']:.3f} of eager's   phases (s): "
            f"{_phases(r['phase_seconds']['blocks'])}"
        )
    write_json(args.json, {"args": vars(args), **out})
    return 0


def _overlap(args: argparse.Namespace) -> int:
    """The iteration with a reward server's latency, scored after the rollout or beside it (module docstring)."""
    import socket
    import subprocess
    import time

    import httpx

    folder = tempfile.mkdtemp()
    reward = os.path.join(folder, "latency_reward.py")
    with open(reward, "w") as f:
        f.write(LATENCY_REWARD)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "sp_diffusers.cli", "reward-server", "--reward", f"{reward}:score", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        entry = {"url": url, "input": "latents", "kwargs": {"seconds_per_sample": args.reward_seconds}}
        out = {}
        for workload in args.workload:
            # each SP group's samples (prompts_per_rank x group_size)
            samples = (1 if workload == "video" else 2) * (args.group_size or (2 if workload == "video" else 4))
            variants = {
                f"chunks {n}": {**VARIANTS["after"], "rollout.chunks": n, "flowgrpo.rewards": [entry]}
                for n in args.chunks
                if n <= samples
            }
            if args.lag:  # the previous iteration's rollout trained, this one's scored meanwhile
                variants["lag 1"] = {**VARIANTS["after"], "update.lag": 1, "flowgrpo.rewards": [entry]}
            r = spawn(
                _rank, 2, workload, args.steps, args.cfg, args.repeats, variants, args.group_size,
                backend=args.backend, device=args.device,
            )[0]
            sec, base = r["seconds"], r["seconds"][f"chunks {args.chunks[0]}"]
            out[workload] = {**r, "ratio": {name: t / base for name, t in sec.items()}}
            print(
                f"\n{workload}: FlowGRPO iteration at SP 2, {args.steps} steps, CFG {args.cfg:g}, a reward server at "
                f"{args.reward_seconds:g} s per sample ({samples * args.reward_seconds:g} s an iteration; {args.device})"
            )
            for name in variants:
                wait = r["reward_wait_seconds"][name]
                waited = f"   waited {wait:6.2f} s for rewards" if wait is not None else ""
                print(f"  {name:<9} {sec[name]:7.2f} s/iteration   {sec[name] / base:.3f} of {args.chunks[0]}'s{waited}")
                print(f"  {'':<9} phases (s): {_phases(r['phase_seconds'][name])}")
        write_json(args.json, {"args": vars(args), **out})
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
