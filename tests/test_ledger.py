"""The communication ledger (sp_diffusers/parallel/ledger.py) on 2 real gloo ranks: every collective counted once, with the
bytes its docstring defines (bus bytes: what one rank puts on its link), under the phase and kind in force; FSDP2's
all-gathers are parameter gathers and its reduce-scatters gradient reductions; torch's functions are its own again
once nothing records. Bytes are integers computed from shapes, so the expected figures below are exact."""

from __future__ import annotations

import functools

from ._dist import run_distributed

ROW = 4 * 4  # one row of the 6 x 4 fp32 test tensor


@functools.cache
def _collectives():
    return run_distributed("tests.workers.ledger_checks:collectives", 2)


@functools.cache
def _fsdp():
    return run_distributed("tests.workers.ledger_checks:fsdp", 2)


def test_each_collective_is_counted_once_with_its_bus_bytes():
    for rank, r in enumerate(_collectives()):
        assert r["a2a_even"] == {"rollout/activation": (1, 3 * ROW)}  # half of the 6 rows leave
        # uneven splits: what leaves is the input less the block the rank keeps (rank 0 keeps 1 row, rank 1 4)
        assert r["a2a_uneven"] == {"rollout/activation": (1, (5 if rank == 0 else 2) * ROW)}
        # the list form and the tensor form of the all-gather: (P-1)/P of the 2 x 6-row output each
        assert r["gathers"] == {"other/activation": (2, 2 * 6 * ROW)}
        assert r["reduce_broadcast"] == {
            "other/agreement": (1, 12),  # all-reduce of 3 floats: 2 x 12 x (P-1)/P
            "other/grad_reduce": (1, 12),  # the same, inside comm_kind("grad_reduce")
            "other/data": (1, 12),  # broadcast: the whole tensor
        }
        calls, nbytes = r["object"]["reward/agreement"]
        assert list(r["object"]) == ["reward/agreement"] and calls == 2 and nbytes > 0  # sizes, then pickles
        # the functional collectives (diffusers' gathers, DTensor's reductions); the deprecated alias once
        assert r["funcol"] == {"train_forward/activation": (2, 6 * ROW + 3 * ROW), "train_forward/agreement": (1, 12)}
        assert r["p2p"] == {"rollout/activation": (1, 40)}  # the isend's 10 floats; a receive sends nothing
        if rank == 0:  # the wrapped call still does the exchange: rank 0's own row 0, then rank 1's rows 0-1
            assert r["a2a_uneven_values"] == [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]


def test_a_nested_recording_counts_alone_and_torch_is_restored():
    for r in _collectives():
        assert r["nested_inner"] == {"other/agreement": (1, 12)}
        assert r["nested_outer"] == {"other/agreement": (1, 12)}  # the inner call is not counted twice
        assert r["during"] and r["restored"]
        assert r["after"] == {}  # nothing records outside


def test_fsdp_collectives_are_parameter_gathers_and_gradient_reductions():
    for r in _fsdp():
        half = r["param_bytes"] // 2  # bus bytes of gathering (or reduce-scattering) every parameter once at P=2
        step = r["step"]
        assert step["train_forward/param_gather"] == (2, half)  # one all-gather per block
        assert step["train_backward/param_gather"] == (2, half)  # resharded after forward: gathered again
        assert step["train_backward/grad_reduce"] == (2, half)  # one reduce-scatter per block
        assert r["per_forward"] == {"rollout/param_gather": (6, 3 * half)}  # every forward gathers every block
        assert r["held"] == {"rollout/param_gather": (2, half)} and r["held_equal"]  # held: the first forward only
        assert r["after_hold"] == {"rollout/param_gather": (2, half)}  # released: per forward again
        assert r["gathered_bytes"] == r["param_bytes"]
