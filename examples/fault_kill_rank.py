"""Kill a rank mid-run and show that nothing is lost: torchrun --max-restarts restarts the job, it resumes
from the last checkpoint and ends with exactly the parameters of an uninterrupted run.

    .venv/bin/python examples/fault_kill_rank.py [--iterations 12] [--save-every 3] [--kill-after 7] [--json out.json]

1. an uninterrupted run (torchrun, 2 CPU ranks, SP = 2) -> reference checkpoint;
2. the same run under ``torchrun --max-restarts 1``; once rank 0 has logged iteration ``--kill-after``,
   one worker process (rank 1) gets SIGKILL; torchrun tears the group down and restarts it; the trainer
   resumes from ``latest``;
3. compare every model and optimizer tensor of the two final checkpoints, and count the iterations that
   had to be recomputed (the ones after the last checkpoint before the kill).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _torchrun() -> str:
    candidate = Path(sys.executable).parent / "torchrun"
    return str(candidate) if candidate.exists() else "torchrun"


def _command(out: Path, args, max_restarts: int) -> list[str]:
    return [
        _torchrun(),
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        str(max_restarts),
        "-m",
        "sp_diffusers.cli",
        "train",
        "--config",
        str(ROOT / "examples/configs/tiny_qwenimage_sp2.yaml"),
        "--iterations",
        str(args.iterations),
        "--out-dir",
        str(out),
        "--set",
        f"train.save_every={args.save_every}",
        "--set",
        "train.progress=false",
        "--set",
        "train.plot=false",
        "--set",
        "flowgrpo.prompts_per_rank=2",
        "--set",
        "flowgrpo.micro_batch_size=8",
    ]


def _logged_iterations(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1])["iteration"] if lines else 0


def _workers(parent_pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(parent_pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(p) for p in found)


def _final_tensors(out: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    latest = (out / "checkpoints" / "latest").read_text().strip()
    target = out / "final.pt"
    dcp_to_torch_save(str(out / "checkpoints" / latest), str(target))
    return torch.load(target, weights_only=False)


def _flatten(prefix: str, value, into: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, into)
    else:
        into[prefix] = value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="sp-fault-"))

    reference = work / "uninterrupted"
    done = subprocess.run(_command(reference, args, 0), cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        # The reference run's own output is the only clue to why it failed: keep its tail in the error.
        raise SystemExit(
            f"the uninterrupted run exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
        )

    faulty = work / "killed"
    killed_at, victim = None, None
    with open(work / "killed.log", "w") as log:
        proc = subprocess.Popen(
            _command(faulty, args, 1), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            logged = _logged_iterations(faulty)
            if killed_at is None and logged >= args.kill_after:
                workers = _workers(proc.pid)
                if len(workers) == 2:
                    victim = workers[1]
                    os.kill(victim, signal.SIGKILL)
                    killed_at = logged
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            raise SystemExit("the restarted job did not finish in 600 s")
    if proc.returncode != 0:
        raise SystemExit(f"torchrun exited with {proc.returncode}; see {work / 'killed.log'}")
    text = (work / "killed.log").read_text()
    resumed_from = None
    for line in text.splitlines():
        if line.startswith("resumed from"):
            resumed_from = int(line.split("at iteration")[1])
    ref, got = {}, {}
    _flatten("", _final_tensors(reference), ref)
    _flatten("", _final_tensors(faulty), got)
    import torch

    tensor_keys = [k for k, v in ref.items() if torch.is_tensor(v)]
    max_diff = max((ref[k].double() - got[k].double()).abs().max().item() for k in tensor_keys)
    report = {
        "iterations": args.iterations,
        "save_every": args.save_every,
        "killed_after_iteration": killed_at,
        "killed_pid": victim,
        "faults_survived": int(killed_at is not None and resumed_from is not None),
        "resumed_from_iteration": resumed_from,
        "iterations_recomputed": (killed_at - resumed_from)
        if killed_at and resumed_from is not None
        else None,
        "tensors_compared": len(tensor_keys),
        "max_abs_diff_vs_uninterrupted": max_diff,
        "metrics_iterations": _logged_iterations(faulty),
        "log": str(work / "killed.log"),
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = (
        report["faults_survived"] == 1
        and max_diff == 0.0
        and report["iterations_recomputed"] <= args.save_every
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
