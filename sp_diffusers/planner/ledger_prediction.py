"""One RL iteration's communication ledger at one layout, predicted by a fake run of the real class (no planning
around it: the tests and benchmarks hold it to what the trainer counts, ``comm/<phase>/<kind>`` in metrics.jsonl).
"""

from __future__ import annotations

from dataclasses import replace

from .iteration import Ledger, Pieces, RLKnobs, compose
from .models import ModelSpec
from .shapes import Workload
from .trace import TraceRequest, run_trace

__all__ = ["predict_iteration_ledger"]


def predict_iteration_ledger(
    spec: ModelSpec,
    work: Workload,
    world: int,
    ulysses: int,
    rl: RLKnobs,
    held: bool,
    ring: int = 1,
    lora_rank: int | None = None,
    dtype: str = "fp32",
    replicate: int = 1,
    update_held: bool = False,
) -> Ledger:
    """Rank 0's ledger of one iteration (``work.batch`` the training micro-batch, ``work.text_len`` the text the
    model sees) at ``world`` ranks of ``ulysses x ring`` SP groups (``replicate`` HSDP replica groups); ``held``: the
    rollout's weights gathered once; ``update_held``: an optimizer step's micro-steps on weights gathered once."""
    batch = work.batch * (2 if rl.cfg else 1)
    req = TraceRequest(
        spec, replace(work, batch=batch), world, ulysses, ring, False, lora_rank, dtype, "cpu", rollout=False, rl=rl,
        replicate=replicate,
    )
    train, _ = run_trace(req)
    return compose(Pieces(**train.pieces), rl, work.batch, held, update_held)
