"""Online Diffusion-DPO under sequence parallelism on real gloo ranks vs one process (tests/workers/dpo_steps.py).

The rollout (Euler, 6 steps, the trained policy) within ``1e-4`` of one process, as tests/test_engine.py holds
Flow-GRPO's (fp32 attention over reordered blocks, through six steps), and the same pairs. Then one update on fixed
pairs (LoRA with random A and B, so the policy is not the reference and every margin differs from 0; and full
fine-tuning against the frozen copy of the initial weights; at verl-omni's online recipe beta 100): the loss, every gradient and every parameter after the step equal the one-process run at
Ulysses 2 and Ulysses 2 x Ring 2, within bounds derived from how the loss conditions fp32 rounding:

- The loss is ``-log sigmoid(inside)``, ``inside = beta / 2 x`` differences of four mean squared errors of size
  ``E`` (``model_error``; ~16 here: random LoRA B leaves the velocities far from the target). The layouts round the
  velocities differently (reordered attention sums, ~1e-7 relative; ``EPS`` = 1e-6 allows ten times that), so each
  error moves by ~``EPS E`` and the loss, whose slope in ``inside`` is at most 1, by at most
  ``beta / 2 x 4 EPS E`` (3e-3 here; measured 6e-5).
- A gradient is ``beta / 2`` times weighted differences of the chosen and the rejected sample's error gradients,
  terms of size ``|v - u| |dv/dtheta|`` that cancel in part: their rounding reaches the difference at the scale of
  the tensor's largest entries. Each tensor within ``1e-3`` of its largest entry (measured 1.3e-4 at U2 x R2), plus
  tests/_parity.py's ``1e-4 |ref|``; parameters within the AdamW step's Lipschitz bound of that gradient bound. A
  sharding bug moves a velocity by O(1), the loss by O(beta) and the gradients by O(1) of their scale; a wrong
  reduction (an SP mean halving the gradient) by half of it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from ._dist import run_distributed
from ._parity import _ULP, GRAD_RTOL, PARITY_EPS, PARITY_LR
from .workers.dpo_steps import BETA

LAYOUTS = {"sp2": (2, 2, 1), "ring2_ulysses2": (4, 2, 2)}  # name: (world, ulysses, ring)
EPS = 1e-6  # relative fp32 rounding of a flow-matching error across layouts (ten times the measured)
SCALE_RTOL = 1e-3  # of a tensor's largest gradient entry


def _grad_tol(g_ref: torch.Tensor) -> torch.Tensor:
    return SCALE_RTOL * g_ref.abs().max() + GRAD_RTOL * g_ref.abs()


def _step_tol(p_ref: torch.Tensor, g_ref: torch.Tensor) -> torch.Tensor:
    """tests/_parity.adam_step_tolerance with this test's gradient bound."""
    tol_g = _grad_tol(g_ref)
    lipschitz = PARITY_LR * tol_g / ((g_ref.abs() - tol_g).clamp_min(0.0) + PARITY_EPS)
    return lipschitz + 2 * _ULP * p_ref.abs() + 1e-6 * PARITY_LR


@functools.cache
def _run(world: int, sp: int, ring: int, lora: bool):
    return run_distributed("tests.workers.dpo_steps:dpo_step", world, sp, ring, lora)


@pytest.mark.parametrize(
    "layout, lora", [("sp2", True), ("ring2_ulysses2", True), ("sp2", False)], ids=["sp2", "ring2_ulysses2", "sp2-full"]
)
def test_diffusion_dpo_update_matches_one_process(layout, lora):
    world, sp, ring = LAYOUTS[layout]
    ref = _run(1, 1, 1, lora)[0]
    results = _run(world, sp, ring, lora)
    root = Path(__file__).resolve().parents[1]
    assert all(Path(r["package"]).is_relative_to(root) for r in results), "ranks import another checkout"
    got = results[0]
    # the rollout: deterministic, nothing stored but its start; one pair per prompt group of 3, chosen first
    assert got["rollout"]["stored"][1] == 1
    assert (got["rollout"]["final"] - ref["rollout"]["final"]).abs().max().item() <= 1e-4
    assert abs(got["rollout"]["reward_mean"] - ref["rollout"]["reward_mean"]) <= 1e-5
    assert got["rollout"]["labels"] == ref["rollout"]["labels"]
    assert sorted(got["rollout"]["labels"]) == [-1, -1, 0, 0, 1, 1]
    kept = got["rollout"]["kept"]
    assert len(kept) == 4 and [got["rollout"]["labels"][i] for i in kept] == [1, -1, 1, -1]
    loss_tol = BETA / 2 * 4 * EPS * ref["metrics"]["model_error"]
    for r in results:  # SP peers report the same loss; it is the one-process loss
        assert r["loss"] == results[0]["loss"]
        assert abs(r["loss"] - ref["loss"]) <= loss_tol, (r["loss"], ref["loss"], loss_tol)
    assert got["metrics"]["trained_samples"] == 8.0
    if lora:
        assert abs(got["metrics"]["implicit_reward_margin"]) > 1e-3  # the policy is not the reference: a real loss
    else:  # full fine-tuning: the frozen copy is the reference, equal to the policy at the first step, and stays
        # the initial weights after the step and another attach (what a checkpoint load calls)
        assert abs(got["metrics"]["implicit_reward_margin"]) <= loss_tol and abs(got["loss"] - 0.6931472) <= loss_tol
        assert got["reference_moved"] == 0.0 and ref["reference_moved"] == 0.0
    nonzero = 0
    for name, g_ref in ref["grads"].items():
        err = (got["grads"][name] - g_ref).abs()
        assert (err <= _grad_tol(g_ref)).all(), f"{layout}: grad {name} off by {err.max():.3e}"
        nonzero += int(g_ref.abs().max() > 0)
    assert nonzero >= 0.8 * len(ref["grads"]) and set(got["grads"]) == set(ref["grads"])
    assert ref["step_moved"] > 0.1 * PARITY_LR and got["step_moved"] > 0.1 * PARITY_LR
    for name, p_ref in ref["params"].items():
        err = (got["params"][name] - p_ref).abs()
        assert (err <= _step_tol(p_ref, ref["grads"][name])).all(), f"{layout}: parameter {name} off by {err.max():.3e}"
