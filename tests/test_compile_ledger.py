"""The communication ledger counts the collectives inside compiled blocks (``tests/workers/compile_ledger.py``
says how each case runs).

``compile_model(model, "blocks")`` compiles through ``sp_diffusers.engine.compiling.counting_backend``: each
forward and backward graph adds its collectives to the recording ledger when it runs. One 4-rank process group,
the tiny Qwen-Image model at an uneven length (every rank's length differs: its text key mask rides with K/V),
the trainer's phases (a no-grad rollout forward, a training forward, its backward). Asserted:

- Ulysses 4 through inductor (``compile_model``'s default backend): the compiled ledger equals eager's exactly,
  calls and bytes per (phase, kind), and the compiled graphs did run (forward and backward);
- Ulysses 2 x Ring 2 (graphs run as they are): what the graphs issue, against eager's calls - the ring's shift of
  K/V and of its key mask is one ``batch_isend_irecv`` eagerly and one all-to-all each in a graph (one call more
  per block and forward, the same bytes); the backward's shift of K/V is the forward's, which AOT autograd's CSE
  merges and keeps (one call and one K/V chunk fewer per block).
"""

from __future__ import annotations

import functools

from ._dist import run_distributed

CASES = [("qwenimage", "uneven", 4, 1, "inductor"), ("qwenimage", "uneven", 2, 2, "graph")]
BLOCKS = 2  # the tiny Qwen-Image's blocks: one graph class, each graph run once per forward


@functools.cache
def _results() -> list[dict]:
    return run_distributed("tests.workers.compile_ledger:compile_ledger", 4, CASES, timeout=600)


def _case(rank: int, name: str) -> dict:
    r = _results()[rank][name]
    assert "error" not in r, f"rank {rank} {name}: {r.get('error')}"
    return r


def test_compiled_blocks_count_exactly_what_eager_counts_under_ulysses():
    for rank in range(4):
        r = _case(rank, "qwenimage/uneven/u4r1/inductor")
        assert r["graphs"] > 0, r
        # rollout and training forwards, and the backward: one forward graph and one backward graph per block
        assert r["graph_runs"] == 3 * BLOCKS, r
        assert r["compiled"] == r["eager"], (rank, r)
        assert r["compiled"]["train_backward/activation"][0] > 0


def test_compiled_ring_counts_what_its_graphs_issue():
    shapes = set()
    for rank in range(4):
        r = _case(rank, "qwenimage/uneven/u2r2/graph")
        assert r["graph_runs"] == 3 * BLOCKS, r
        eager, compiled = r["eager"], r["compiled"]
        assert eager.keys() == compiled.keys(), (rank, r)
        for key in eager:
            (calls, nbytes), (got_calls, got_bytes) = eager[key], compiled[key]
            if key in ("rollout/activation", "train_forward/activation"):
                # the K/V and key-mask shift: two all-to-alls where eager batches two sends
                assert (got_calls, got_bytes) == (calls + BLOCKS, nbytes), (rank, key, r)
            elif key == "train_backward/activation":
                # no second shift of K/V: the forward's received chunk is kept (uneven: its size is this rank's)
                assert got_calls == calls - BLOCKS and 0 < nbytes - got_bytes < nbytes, (rank, key, r)
                shapes.add((nbytes - got_bytes) // BLOCKS)
            else:
                assert (got_calls, got_bytes) == (calls, nbytes), (rank, key, r)
    assert len(shapes) > 1  # uneven: the K/V chunk a rank keeps differs in size across ranks
