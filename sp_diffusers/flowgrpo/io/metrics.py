"""A run's metrics: the in-memory history, ``metrics.jsonl`` (rank 0), TensorBoard when installed, Weights & Biases
when asked (``train.loggers``), the progress bar, the plot.

On resume the file is cut back to the checkpoint's iteration, so a run restarted from step N continues the
same file with N + 1 (no iteration twice).
"""

from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

__all__ = ["RunLog"]


class RunLog:
    """Per-iteration metrics of one run; only ``rank == 0`` writes anything."""

    def __init__(
        self, out_dir: Path, rank: int, loggers: tuple[str, ...] = ("jsonl", "tensorboard"), project: str = ""
    ) -> None:
        self.out_dir, self.rank = Path(out_dir), rank
        self.loggers, self.project = tuple(loggers), project or "sp-diffusers"
        self.path = self.out_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self._tb = None
        self._wandb = None
        self._bar = None

    def start_progress(self, total: int, initial: int) -> None:
        """A tqdm bar on rank 0, moved by ``append``."""
        if self.rank == 0:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="FlowGRPO", unit="it", dynamic_ncols=True)

    def open(self, config: dict[str, Any]) -> str | None:
        """Create the output folder, write ``config.json``, start TensorBoard (optional) and W&B; what went wrong
        starting W&B (None: nothing), for every rank to agree on (a network that does not answer, a stale key)."""
        if self.rank != 0:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(config, indent=2))
        if "tensorboard" in self.loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except Exception:  # tensorboard is optional
                self._tb = None
        if "wandb" in self.loggers:
            try:
                self._wandb = _wandb_run(self.out_dir, self.project, config)
            except Exception as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                return f"W&B did not start ({type(err).__name__}: {first[:300]})"
        return None

    def append(self, metrics: dict[str, Any]) -> None:
        self.history.append(metrics)
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, metrics["iteration"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(metrics["iteration"]))
        if self._bar is not None:
            self._bar.update(1)
            # what moves in an on-policy run (its loss is ~0 and ppo_kl 0 by construction)
            moving = (
                {"reward": f"{metrics['reward_mean']:+.3f}"}
                if "reward_mean" in metrics  # offline preference pairs: the margin
                else {"margin": f"{metrics.get('implicit_reward_margin', 0.0):+.3f}"}
            )
            self._bar.set_postfix(
                **moving,
                clip=f"{metrics.get('clipfrac', 0.0):.2f}",
                grad=f"{metrics.get('grad_norm', 0.0):.2f}",
                s_it=f"{metrics['seconds']:.1f}",
            )

    def truncate(self, iteration: int) -> None:
        """Keep the lines up to ``iteration`` (resuming from its checkpoint) as the history."""
        if self.rank != 0 or not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line and json.loads(line)["iteration"] <= iteration
        ]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.history = [json.loads(line) for line in kept]

    def close(self, plot: bool, title: str = "") -> None:
        if self.rank != 0:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if plot:
            from .plot import plot_metrics

            plot_metrics(self.history, self.out_dir / "metrics.png", title or self.out_dir.name)


def _wandb_run(out_dir: Path, project: str, config: dict[str, Any]) -> Any:
    """A Weights & Biases run for ``out_dir``: its id kept in ``out_dir/wandb_run_id``, so a run resumed from a
    checkpoint continues the same W&B run (W&B keeps the first value of a step it has seen: the iterations redone
    after a restart show in metrics.jsonl, not twice there); files under ``out_dir/wandb``. ``WANDB_MODE=offline``
    writes it to disk only."""
    import wandb

    id_file = out_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(8)
    id_file.write_text(run_id)
    return wandb.init(
        project=project, name=out_dir.name, id=run_id, resume="allow", dir=str(out_dir), config=config
    )
