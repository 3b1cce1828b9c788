"""Rewards off the rollout's critical path: with ``rollout.chunks: N``, each chunk of the rollout is decoded and
scored in one background thread while the next chunk samples; the shares are gathered once the rollout (and the
old policy's recomputation) is done.

The thread runs no collective (``Scorer.share``: this SP rank's share of the chunk, local work only), so the
rollout's collectives keep one order on every rank; the one all-gather of the scores, and the agreement on a
failure, run on the main thread (``Scorer.combine``). What overlaps is what the thread waits on or computes beside the
rollout: a reward server's answer (``flowgrpo.rewards: [{url: ...}]``, the thread waits on the network), a reward
model on another device, or on a GPU the VAE and the reward model on a stream of their own (the chunk's latents are
handed over with an event, not a synchronisation). On a CPU whose cores the rollout already keeps busy, the thread
shares them: measure it (``benchmarks/rl_iteration.py --reward-seconds``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .scoring import Scorer, Scores, Share

__all__ = ["BackgroundScoring"]


@contextlib.contextmanager
def _side_stream(latents: torch.Tensor, ready: Any) -> Iterator[None]:
    """On CUDA: the scoring on a stream of its own, after the event the rollout recorded (``ready``)."""
    if ready is None:
        yield
        return
    stream = torch.cuda.Stream(latents.device)
    stream.wait_event(ready)
    latents.record_stream(stream)  # the allocator keeps the chunk's latents until this stream is done with them
    with torch.cuda.stream(stream):
        yield


class BackgroundScoring:
    """The chunks of one rollout scored in a background thread, in the order they are submitted.

    ``submit(final, prompts, metadata, source_pixels)`` hands a chunk over; ``result()`` waits for every chunk and
    returns the batch's :class:`~.scoring.Scores` as ``Scorer.__call__`` does. Use it as a context manager: the
    thread is stopped on the way out, also when the iteration fails."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sp-diffusers-rewards")
        self._futures: list[Future[Share]] = []
        self._lock = threading.Lock()
        self.busy_seconds = 0.0  # the thread's time decoding and scoring
        self.wait_seconds = 0.0  # the main thread's time waiting for it in result()
        self.device = torch.device("cpu")

    def __enter__(self) -> BackgroundScoring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the thread: what is queued is dropped, what runs finishes."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(
        self,
        final: torch.Tensor,
        prompts: list[str],
        metadata: list[dict],
        source_pixels: torch.Tensor | None = None,
    ) -> None:
        self.device = final.device
        ready = None
        if final.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self._futures.append(self._pool.submit(self._score, final, prompts, metadata, source_pixels, ready))

    def _score(
        self, final: torch.Tensor, prompts: list[str], metadata: list[dict], sources: Any, ready: Any
    ) -> Share:
        start = time.perf_counter()
        with _side_stream(final, ready):
            share = self.scorer.share(final, prompts, metadata, sources)
        with self._lock:
            self.busy_seconds += time.perf_counter() - start
        return share

    def result(self) -> Scores:
        """Every submitted chunk's scores, gathered over the SP group (collectives: call it on every rank)."""
        start = time.perf_counter()
        shares = [f.result() for f in self._futures]
        self.wait_seconds += time.perf_counter() - start
        return self.scorer.combine(shares, self.device)
