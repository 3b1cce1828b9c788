"""Wan2.2-A14B's two experts: ``transformer`` for the high-noise steps, ``transformer_2`` for the low-noise ones,
switched at ``boundary_ratio`` as ``WanPipeline`` switches them (timestep >= ratio x num_train_timesteps: the
first), each an ``FSDPEngine`` of its own, trained (shards, optimizer, LoRA) or frozen (``model.experts`` chooses;
``EngineSettings(frozen=True)``: sharded like the trained one, in the compute dtype, no gradients, no optimizer: a
rank holds 1/world of it, not a whole copy).

``ExpertEngines`` looks like one engine to the trainer: ``for_step(i)`` is the expert of schedule step i (a host
lookup: no sync), the rest (layout, batches, groups) is the first trained engine's, and ``zero_grad`` /
``optimizer_step`` / checkpoints cover every trained one (``<checkpoints>/transformer``, ``.../transformer_2``).

FSDP shards each expert over every rank, so every rank must run the same expert at the same moment. The rollout's
steps are the same everywhere; for training, the algorithm draws its trained steps from the iteration alone, the
same on every data-parallel rank, and only steps of trained experts (``Algorithm.share_plan``: flow_grpo's window
start, dance_grpo's one subset for the whole batch).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...engine import FSDPEngine
from ...engine.checkpoint import find_latest
from ..config import ConfigError, TrainConfig

__all__ = ["ExpertEngines", "build_engines", "check_expert_steps", "route"]


class ExpertEngines:
    """The experts of one model, by name, and which runs each schedule step (``bind_schedule``)."""

    def __init__(self, experts: dict[str, FSDPEngine], boundary_timestep: float) -> None:
        self.experts, self.boundary_timestep = experts, float(boundary_timestep)
        self.trained = {n: e for n, e in experts.items() if not e.settings.frozen}
        self.primary = next(iter(self.trained.values()))
        self.route: list[str] = []

    def __getattr__(self, name: str) -> Any:  # layout, groups, device, batches: the first trained engine's
        if name in ("experts", "trained", "primary", "route"):
            raise AttributeError(name)
        return getattr(self.primary, name)

    def bind_schedule(self, timesteps: torch.Tensor) -> None:
        """Step i runs ``transformer`` when ``timesteps[i] >= boundary``, else ``transformer_2`` (as WanPipeline)."""
        names = list(self.experts)
        self.route = [names[0] if float(t) >= self.boundary_timestep else names[-1] for t in timesteps.tolist()]

    def for_step(self, step: int) -> FSDPEngine:
        return self.experts[self.route[step]]

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def release_params(self) -> None:
        for e in self.experts.values():
            e.release_params()

    def trainable_steps(self) -> list[int]:
        return [i for i, name in enumerate(self.route) if name in self.trained]

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for e in self.experts.values():
                stack.enter_context(e.eval_mode())
            yield

    @contextlib.contextmanager
    def gathered_params(self, backward: bool = False) -> Iterator[None]:
        """Every trained expert's parameters held (an optimizer step's micro-steps may run both)."""
        with contextlib.ExitStack() as stack:
            for e in self.trained.values():
                stack.enter_context(e.gathered_params(backward))
            yield

    def ema_step(self) -> None:
        for e in self.trained.values():
            e.ema_step()

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for e in self.trained.values():
                stack.enter_context(e.ema_weights())
            yield

    def zero_grad(self) -> None:
        for e in self.trained.values():
            e.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """Each trained expert clips and steps on its own; ``grad_norm`` is the norm over both."""
        out = {n: e.optimizer_step() for n, e in self.trained.items()}
        metrics = dict(out[next(iter(out))])
        metrics["grad_norm"] = math.sqrt(sum(m["grad_norm"] ** 2 for m in out.values()))
        metrics["step_skipped"] = max(m["step_skipped"] for m in out.values())
        metrics.update({f"grad_norm/{n}": m["grad_norm"] for n, m in out.items()})
        return metrics

    def save_checkpoint(self, root: str | Path, step: int | None = None, extra: dict | None = None) -> Path:
        paths = [e.save_checkpoint(Path(root) / n, step, extra) for n, e in self.trained.items()]
        return paths[0]

    def find_latest(self, root: str | Path) -> Path | None:
        found = {n: find_latest(Path(root) / n) for n in self.trained}
        if all(p is None for p in found.values()):
            return None
        steps = {n: (p.name if p is not None else None) for n, p in found.items()}
        if len(set(steps.values())) > 1:
            from ...engine.checkpoint_files import CheckpointError

            raise CheckpointError(
                f"the experts' newest checkpoints differ ({steps}) under {root}; fix: point each expert's 'latest' "
                "at the same step-* folder (the older one), or delete the newer one"
            )
        return next(iter(found.values()))

    def reset_optimizer(self) -> None:
        for engine in self.trained.values():
            engine.reset_optimizer()

    def load_checkpoint(self, root: str | Path) -> dict[str, Any]:
        extras = [e.load_checkpoint(Path(root) / n) for n, e in self.trained.items()]
        return extras[0]


def route(engine: Any, step: int | None) -> Any:
    """The engine that runs schedule step ``step``: an expert's, or ``engine`` itself when it has one model."""
    return engine.for_step(step) if step is not None and isinstance(engine, ExpertEngines) else engine


def build_engines(config: TrainConfig, model: torch.nn.Module | None, factory: Any) -> Any:
    """One ``factory(model, settings)`` engine (``model``, else ``build_model``), or, for a two-expert Wan2.2
    pipeline, ``ExpertEngines``: each expert built on meta and loaded shard by shard by its engine (a frozen one
    by an ``FSDPEngine(frozen=True)``, whatever ``factory`` builds the trained ones)."""
    from ..build import build_model, engine_settings
    from .pipeline_io import boundary_ratio, expert_names, meta_transformers

    names = expert_names(config) if model is None else ("transformer",)
    chosen = list(config.model.experts) or list(names)
    unknown = sorted(set(chosen) - set(names))
    if unknown or not chosen:
        raise ConfigError(
            f"model.experts={config.model.experts}: the pipeline's transformers are {list(names)}; fix: a non-empty "
            "subset of them (Wan2.2: transformer = high noise, transformer_2 = low noise), or [] for all"
        )
    if len(names) == 1:
        model = model if model is not None else build_model(config)
        return factory(model, engine_settings(config, model))
    ratio = boundary_ratio(config)
    if ratio is None:
        raise ConfigError(f"model.pipeline={config.model.pipeline!r} has two transformers but no boundary_ratio")
    trained = meta_transformers(config, tuple(n for n in names if n in chosen))
    engines: dict[str, Any] = {n: factory(m, engine_settings(config, m, n)) for n, m in trained.items()}
    frozen = meta_transformers(config, tuple(n for n in names if n not in chosen))
    for n, m in frozen.items():  # sharded like the trained expert, loaded shard by shard, forward only
        engines[n] = FSDPEngine(m, engine_settings(config, m, n).replace(frozen=True, lora=None))
    experts = {n: engines[n] for n in names}
    return ExpertEngines(experts, ratio * 1000.0)


def check_expert_steps(engine: ExpertEngines, algorithm: Any) -> None:
    """Refuse a run whose algorithm never trains a step of a trained expert (``Algorithm.check_trainable``)."""
    owners = dict(enumerate(engine.route))
    algorithm.check_trainable(set(engine.trainable_steps()), owners, list(engine.trained))
